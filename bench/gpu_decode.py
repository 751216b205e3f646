"""GPU decode benchmark: step time at batch 1/16/64 against its HBM floor, CUDA-graph gain, prefill tokens/s.

The floor is (weight bytes + K/V bytes read) / the device-to-device copy bandwidth measured in the same run,
and `x_floor_sold` the same against the HBM bandwidth the device is sold at (`SOLD_BANDWIDTH` by
`torch.cuda.get_device_name`; null for a device not listed). Targets (the 8B shape, bf16 weights): batch 1
<= 1.5x its floor, batch 64 <= 2x, CUDA graphs >= 1.5x eager at batch 1; `met` per result, and the run exits 1
when one is missed or a variant fails (`--no-targets`: 0); other shapes are measured without targets.
Models are random-weight Llama shapes (no download): the default model's (SmolLM2-135M) and an 8B one. One
JSON line. Run: `python -m bench.gpu_decode [--shapes smollm2-135m,llama-8b] [--fp8] [--kv-int8] [--ctx N]`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback

import torch

from bench.machine import add_no_targets, exit_code
from worker.config import EngineConfig, ModelConfig
from worker.engine.runner import ModelRunner
from worker.kvcache.tensors import bytes_per_page
from worker.model.attention import BatchLayout
from worker.model.cuda_graphs import DecodeInputs
from worker.model.llama import StepContext
from worker.model.tiny_model import random_model

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                         head_dim=64, tie_word_embeddings=True, vocab_size=49152),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, tie_word_embeddings=True, vocab_size=49152),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
                     head_dim=64, tie_word_embeddings=True, vocab_size=128256),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                     head_dim=128, tie_word_embeddings=False, vocab_size=128256),
}
BATCHES = (1, 16, 64)


# HBM bandwidth as sold (bytes/s), by a substring of the device name, first match (GH200's depends on its
# memory: unknown): the floor against it is reported beside the measured-copy floor, which is lower (4.2
# against 4.8 TB/s on an H200) and so flatters the x_floor ratio
SOLD_BANDWIDTH = (("GH200", None), ("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12),
                  ("H100", 3.35e12),
                  ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12),
                  ("L40S", 0.864e12))


TARGETS = {"shape": "llama-8b", "x_floor_b1_max": 1.5, "x_floor_b64_max": 2.0, "graph_speedup_b1_min": 1.5}


def sold_bandwidth(device_name: str) -> float | None:
    """The device's HBM bandwidth as sold (bytes/s), None for a device not in SOLD_BANDWIDTH."""
    return next((bw for key, bw in SOLD_BANDWIDTH if key in device_name), None)


def targets_met(result: dict, key: str = "x_floor") -> dict[str, bool] | None:
    """The targets of one result (TARGETS: the 8B shape with bf16 weights; None for other variants), with the
    floor ratio `key` (`x_floor`: the measured copy bandwidth, `x_floor_sold`: the sold one); a variant that
    failed or a batch not measured misses."""
    if result.get("shape") != TARGETS["shape"] or result.get("quantization") != "none":
        return None
    rows = result.get("decode", {})

    def field(batch: str, name: str) -> float | None:
        return rows.get(batch, {}).get(name)

    b1, b64, speedup = field("1", key), field("64", key), field("1", "graph_speedup")
    return {"x_floor_b1": b1 is not None and b1 <= TARGETS["x_floor_b1_max"],
            "x_floor_b64": b64 is not None and b64 <= TARGETS["x_floor_b64_max"],
            "graph_speedup_b1": speedup is not None and speedup >= TARGETS["graph_speedup_b1_min"]}


def copy_bandwidth(dev: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * nbytes / _time(lambda: dst.copy_(src), 10)


def _time(fn, iters: int) -> float:
    """Seconds per call, by CUDA events around `iters` calls after two warm-ups (wall clock without CUDA)."""
    fn()
    fn()
    if not torch.cuda.is_available():  # the CPU smoke run (tests/test_gpu_bench_smoke.py)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def _profile(fn, title: str) -> None:
    """Where a step's device time goes: the kernels of 10 steps, by total time (to stderr)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    print(f"== {title}: kernels of 10 steps", file=sys.stderr)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60),
          file=sys.stderr)


def read_bytes(model: torch.nn.Module, cfg: ModelConfig) -> int:
    """Bytes a decode step reads of the weights: every parameter and buffer once, but of an untied embedding
    table only the batch's rows (counted as none)."""
    seen, total = set(), 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.data_ptr() in seen or (name.startswith("embed") and not cfg.tie_word_embeddings):
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def decode_inputs(batch: int, ctx: int, page: int) -> DecodeInputs:
    per = -(-(ctx + page) // page)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    pos = ctx - 1
    return DecodeInputs([1] * batch, [pos] * batch,
                        [t[pos // page] * page + pos % page for t in tables], tables, [ctx] * batch)


def eager_step(runner: ModelRunner, inp: DecodeInputs) -> torch.Tensor:
    dev = runner.device
    lay = BatchLayout(runner.bs, torch.tensor(inp.slots, device=dev), inp.tables, inp.lens, [], [], [])
    n = len(inp.ids)
    ctx = StepContext(torch.tensor(inp.positions, device=dev), torch.arange(n, device=dev), runner.attn,
                      runner.attn.prepare(lay, dev), runner.kv, runner.ops)
    return runner.model(torch.tensor(inp.ids, device=dev), ctx).argmax(-1)


def prefill_tok_s(runner: ModelRunner, chunks: int, length: int) -> float:
    dev, page = runner.device, runner.bs
    per = -(-length // page)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(chunks)]
    slots = [t[p // page] * page + p % page for t in tables for p in range(length)]
    lay = BatchLayout(page, torch.tensor(slots, device=dev), [], [], tables, [length] * chunks,
                      [length] * chunks)
    ids = torch.ones(chunks * length, dtype=torch.int64, device=dev)
    pos = torch.arange(length, device=dev).repeat(chunks)
    rows = torch.arange(1, chunks + 1, device=dev) * length - 1

    def step() -> torch.Tensor:
        ctx = StepContext(pos, rows, runner.attn, runner.attn.prepare(lay, dev), runner.kv, runner.ops)
        return runner.model(ids, ctx)

    return chunks * length / _time(step, 5)


def bench_shape(name: str, bw: float, ctx: int, quantization: str, eager_batches: tuple[int, ...],
                prefill_len: int, dev: torch.device, iters: int = 50, profile: bool = False,
                kv_dtype: str = "model", batches: tuple[int, ...] = BATCHES,
                fused_linear: str = "auto") -> dict:
    cfg = ModelConfig(max_position=8192, **SHAPES[name])
    tok = os.environ.get("SWITCHYARD_TOKENIZER", "default")
    loaded = random_model(cfg, dtype="bfloat16", device=dev, tokenizer=tok, on_device=True)
    if quantization != "none":
        from worker.quant import weights as quant

        quant.quantize_model(loaded.model, quantization)
        loaded.quantization = quantization
    backend = "triton" if dev.type == "cpu" else "auto"  # CPU: the smoke run, under Triton's interpreter
    ecfg = EngineConfig(max_num_seqs=max(batches), cuda_graphs="on", attention_backend=backend,
                        kv_dtype=kv_dtype, fused_linear=fused_linear)
    per_seq = -(-(ctx + ecfg.block_size) // ecfg.block_size)
    num_pages = max(batches) * per_seq + 8 * (-(-prefill_len // ecfg.block_size))
    runner = ModelRunner(loaded, ecfg, num_pages)
    weights = read_bytes(loaded.model, cfg)
    kv_token = bytes_per_page(cfg, loaded.dtype, ecfg.block_size, runner.kv.kv_dtype) / ecfg.block_size
    out = {"shape": name, "dtype": "bfloat16", "quantization": quantization, "kv_dtype": runner.kv.kv_dtype,
           "attention_backend": runner.attn.name, "fused_linear": fused_linear,
           "fused_linear_active": getattr(runner.ops, "fused_linear", False),  # CPU smoke: never (C++ ops)
           "cuda_graphs": runner.graphs is not None, "weight_bytes": weights, "ctx": ctx, "decode": {}}
    sold = sold_bandwidth(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else None
    with torch.inference_mode():
        for b in batches:
            inp = decode_inputs(b, ctx, ecfg.block_size)
            floor = (weights + b * ctx * kv_token) / bw
            sold_floor = (weights + b * ctx * kv_token) / sold if sold is not None else None
            row = {"floor_ms": round(floor * 1e3, 4),
                   "floor_sold_ms": round(sold_floor * 1e3, 4) if sold_floor is not None else None}
            if runner.graphs is not None:
                step = _time(lambda inp=inp: runner.graphs.run(inp).argmax(-1), iters)
                if profile and b == 1:
                    _profile(lambda inp=inp: runner.graphs.run(inp).argmax(-1),
                             f"{name} {quantization} batch 1")
                row.update(step_ms=round(step * 1e3, 4), x_floor=round(step / floor, 3),
                           x_floor_sold=round(step / sold_floor, 3) if sold_floor is not None else None)
            if b in eager_batches:
                eager = _time(lambda inp=inp: eager_step(runner, inp), max(1, iters // 2))
                row["eager_ms"] = round(eager * 1e3, 4)
                if "step_ms" in row:
                    row["graph_speedup"] = round(eager / step, 2)
            out["decode"][str(b)] = row
        out["prefill_tok_s"] = round(prefill_tok_s(runner, 8, prefill_len))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", help="comma-separated (default smollm2-135m,llama-8b; tiny with --cpu-smoke)")
    ap.add_argument("--ctx", type=int,
                    help="context length of every decoding sequence (default 512; 32 smoke)")
    ap.add_argument("--prefill-len", type=int,
                    help="tokens of each of the 8 prefill chunks (default 1024; 16 smoke)")
    ap.add_argument("--fp8", action="store_true", help="also each shape with fp8 weights (Hopper)")
    ap.add_argument("--kv-int8", action="store_true", help="also each shape with int8 KV pages")
    ap.add_argument("--iters", type=int, help="timed steps (default 50; 1 smoke)")
    ap.add_argument("--fused-linear", choices=["auto", "on", "off", "both"], default="auto",
                    help="norms and SiLU-mul inside the decode projections (both: each variant off, then on)")
    ap.add_argument("--profile", action="store_true",
                    help="print the kernels of batch-1 graph steps (stderr)")
    add_no_targets(ap)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run on CPU under Triton's interpreter (checks the "
                    "bench itself; its times mean nothing)")
    args = ap.parse_args(argv)
    # the interpreter runs a 135M step in minutes: the smoke run is small (batches 1, 2)
    smoke = args.cpu_smoke
    args.shapes = args.shapes or ("tiny" if smoke else "smollm2-135m,llama-8b")
    args.ctx = args.ctx or (32 if smoke else 512)
    args.prefill_len = args.prefill_len or (16 if smoke else 1024)
    args.iters = args.iters or (1 if smoke else 50)
    batches, eager_batches = ((1, 2), (1, 2)) if smoke else (BATCHES, (1, 64))
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print(json.dumps({"bench": "gpu_decode", "error": "no CUDA device"}))
        return 1
    if args.cpu_smoke:  # the Triton backend runs on CPU tensors only under the interpreter
        os.environ["TRITON_INTERPRET"] = "1"
    import triton

    t0 = time.monotonic()
    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    bw = copy_bandwidth(dev, 64 << 20 if args.cpu_smoke else 2 << 30)
    results = []
    for name in args.shapes.split(","):
        variants = [("none", "model")] + [("fp8", "model")] * args.fp8 + [("none", "int8")] * args.kv_int8
        fused = ("off", "on") if args.fused_linear == "both" else (args.fused_linear,)
        for (mode, kv_dtype), linear in ((v, f) for v in variants for f in fused):
            try:
                results.append(bench_shape(name, bw, args.ctx, mode, eager_batches, args.prefill_len, dev,
                                           args.iters, args.profile, kv_dtype, batches, linear))
            except Exception as e:  # one failing variant still reports the others
                traceback.print_exc()
                results.append({"shape": name, "quantization": mode, "kv_dtype": kv_dtype,
                                "fused_linear": linear, "error": f"{type(e).__name__}: {e}"[:300]})
            gc.collect()  # the shape's weights, KV cache and graphs go before the next one is built
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter smoke run)"
    sold = sold_bandwidth(device) if dev.type == "cuda" else None
    met: dict[str, bool] = {}
    for r in results:
        name = f"{r['shape']} {r['quantization']} kv {r['kv_dtype']} fused {r['fused_linear']}"
        r["met"], r["met_sold"] = targets_met(r), targets_met(r, "x_floor_sold") if sold else None
        if r["met"] is not None or "error" in r:
            met[name] = "error" not in r and all(r["met"].values())
    out = {"bench": "gpu_decode", "device": device, "torch": torch.__version__, "triton": triton.__version__,
           "copy_bw_GBps": round(bw / 1e9, 1), "sold_bw_GBps": round(sold / 1e9, 1) if sold else None,
           "targets": TARGETS, "met": met, "results": results, "wall_s": round(time.monotonic() - t0, 1)}
    print(json.dumps(out))
    return exit_code(out, not args.no_targets)


if __name__ == "__main__":
    raise SystemExit(main())
