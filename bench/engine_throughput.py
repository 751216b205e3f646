"""Engine throughput benchmark: our continuous-batching engine vs HF `generate` with static batches.

Same greedy workload on both, one process; `roofline_frac` compares with plain matmuls of the model's shapes.
Targets: `ratio_vs_hf_static` >= 3.0, `roofline_frac` >= 0.5; exits 1 when one is missed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter

import torch
import torch.nn.functional as F

from bench.machine import add_no_targets, exit_code
from worker.config import EngineConfig
from worker.engine.debug import DebugEngine
from worker.model.loader import load_model
from worker.protocol import SamplingParams
from worker.text.model_source import default_model_path

TARGETS = {"ratio_vs_hf_static": 3.0, "roofline_frac": 0.5}  # at least


def workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        plen, olen = rng.randint(32, 512), rng.randint(16, 192)
        out.append(([rng.randrange(3, vocab) for _ in range(plen)], olen))
    return out


def run_engine(engine: DebugEngine, reqs: list[tuple[list[int], int]]) -> tuple[float, list[tuple[int, int]]]:
    """Returns wall seconds and the (tokens, logit rows) of every step."""
    for i, (prompt, olen) in enumerate(reqs):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=olen, ignore_eos=True))
    steps: list[tuple[int, int]] = []
    produced = 0
    t0 = time.perf_counter()
    while engine.has_work():
        outs = engine.step()
        produced += sum(len(o.new_tokens) for o in outs)
        steps.append(engine.runner.last_step_shape)
    wall = time.perf_counter() - t0
    assert produced == sum(o for _, o in reqs), "engine produced the wrong number of tokens"
    return wall, steps


def run_hf(reqs: list[tuple[list[int], int]], dtype: torch.dtype, batch: int) -> float:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    pad = 0
    t0 = time.perf_counter()
    for b in range(0, len(reqs), batch):
        group = reqs[b:b + batch]
        width = max(len(p) for p, _ in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group])
        new = max(o for _, o in group)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=pad)
    return time.perf_counter() - t0


def matmul_shapes(engine: DebugEngine) -> list[tuple[int, int]]:
    """(out, in) of every weight matmul of one token through the model, LM head excluded."""
    m = engine.loaded.model
    layer = m.layers[0]
    shapes = [tuple(lin.weight.shape) for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return shapes * len(m.layers)


def matmul_rate(engine: DebugEngine, steps: list[tuple[int, int]], dtype: torch.dtype) -> float:
    """FLOP/s of plain matmuls of the model's weight shapes at the step sizes the engine used."""
    cfg = engine.loaded.config
    shapes = matmul_shapes(engine)
    dev = engine.loaded.device
    weights = {s: torch.randn(s, dtype=dtype, device=dev) for s in set(shapes)}
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=dev)
    buckets: Counter = Counter()
    for tokens, rows in steps:
        buckets[(_bucket(tokens), _bucket(rows))] += 1
    total_flops = total_time = 0.0
    for (tokens, rows), count in buckets.items():
        x = {k: torch.randn(tokens, k, dtype=dtype, device=dev) for k in {s[1] for s in shapes}}
        xh = torch.randn(rows, cfg.hidden_size, dtype=dtype, device=dev)
        flops = 2 * tokens * sum(o * i for o, i in shapes) + 2 * rows * head.numel()
        best = float("inf")
        for _ in range(3):
            _sync(dev)
            t0 = time.perf_counter()
            for s in shapes:
                F.linear(x[s[1]], weights[s])
            F.linear(xh, head)
            _sync(dev)
            best = min(best, time.perf_counter() - t0)
        total_flops += flops * count
        total_time += best * count
    return total_flops / total_time


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _bucket(n: int) -> int:
    """Round to 2 significant bits so that a few dozen sizes cover the run."""
    if n <= 4:
        return max(n, 1)
    top = 1 << (n.bit_length() - 1)
    step = top >> 2
    return int(round(n / step) * step)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dtype", default="auto", help="auto | bfloat16 | float32")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig().max_num_batched_tokens)
    ap.add_argument("--max-num-seqs", type=int, default=EngineConfig().max_num_seqs)
    ap.add_argument("--skip-hf", action="store_true", help="engine only (for profiling)")
    add_no_targets(ap)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model("default", dtype=args.dtype, device=args.device)
    dtype = loaded.dtype
    engine = DebugEngine(loaded, EngineConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                         max_num_seqs=args.max_num_seqs, kv_cache_bytes=2 << 30))
    reqs = workload(args.requests, args.seed, loaded.config.vocab_size)
    engine.generate([reqs[0][0][:32]], SamplingParams(max_tokens=4))  # warm-up
    wall, steps = run_engine(engine, reqs)
    out_tokens = sum(o for _, o in reqs)
    prompt_tokens = sum(len(p) for p, _ in reqs)
    engine_tok_s = out_tokens / wall
    useful_flops = 2 * loaded.config.num_params() * (prompt_tokens + out_tokens)
    rate = matmul_rate(engine, steps, dtype)
    print(f"engine: {out_tokens / wall:.2f} output tok/s, {wall:.1f}s, {len(steps)} steps, "
          f"roofline_frac {useful_flops / wall / rate:.3f}", file=sys.stderr, flush=True)
    hf_wall = float("nan") if args.skip_hf else run_hf(reqs, dtype, args.hf_batch)
    hf_tok_s = out_tokens / hf_wall
    result = {
        "engine_tok_s": round(engine_tok_s, 2),
        "engine_total_tok_s": round((prompt_tokens + out_tokens) / wall, 2),
        "hf_static_tok_s": round(hf_tok_s, 2),
        "ratio_vs_hf_static": round(engine_tok_s / hf_tok_s, 3),
        "roofline_frac": round(useful_flops / wall / rate, 3),
        "engine_tflops": round(useful_flops / wall / 1e12, 4),
        "matmul_tflops": round(rate / 1e12, 4),
        "engine_s": round(wall, 2), "hf_s": round(hf_wall, 2), "steps": len(steps),
        "preemptions": engine.stats().preemptions,
        "prompt_tokens": prompt_tokens, "output_tokens": out_tokens, "requests": len(reqs),
        "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
        "device": _device_name(loaded.device), "targets": TARGETS,
    }
    result["met"] = {"roofline_frac": result["roofline_frac"] >= TARGETS["roofline_frac"]}
    if not args.skip_hf:
        result["met"]["ratio_vs_hf_static"] = result["ratio_vs_hf_static"] >= TARGETS["ratio_vs_hf_static"]
    if not args.json:
        for k, v in result.items():
            print(f"{k:>22}: {v}", file=sys.stderr)
    print(json.dumps(result))
    return exit_code(result, not args.no_targets)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"cpu:{line.split(':', 1)[1].strip()} x{torch.get_num_threads()} threads"
    except OSError:
        pass
    return "cpu"


if __name__ == "__main__":
    sys.exit(main())
