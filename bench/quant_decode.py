"""Weight-only quantization benchmark: decode step time per mode against its bandwidth floor, and quality.

Quality is perplexity and top-1 agreement with the unquantized model on `tests/data/quant_eval.txt`,
scored through the engine's own paged prefill. Target: each mode's batch-1 step <= 1.15x its floor
(`b1_over_floor`); exits 1 when one misses it.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.machine import add_no_targets, cpu_model, emit
from worker.config import EngineConfig
from worker.engine.core import Engine
from worker.engine.debug import DebugEngine
from worker.model.llama import activation_maxima
from worker.model.loader import LoadedModel, load_model
from worker.protocol import SamplingParams
from worker.quant import w8a8 as smooth
from worker.quant import weights as quant

TARGET_B1_OVER_FLOOR = 1.15  # a batch-1 decode step over its weight-bandwidth floor, at most
EVAL_TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "quant_eval.txt"


@dataclass(slots=True)
class Score:
    nll: torch.Tensor  # [n-1] negative log-likelihood of each next token
    top1: torch.Tensor  # [n-1] argmax prediction at each position

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll.mean().item())


def eval_ids(loaded: LoadedModel) -> list[int]:
    return loaded.tokenizer.encode(EVAL_TEXT.read_text())


def score(loaded: LoadedModel, ids: list[int], chunk: int, kv_dtype: str = "model") -> Score:
    """Next-token NLL and argmax of every position, prefilled `chunk` tokens per engine step."""
    cfg = EngineConfig(kv_cache_bytes=256 << 20, max_num_batched_tokens=chunk, enable_prefix_cache=False,
                       kv_dtype=kv_dtype)
    engine = DebugEngine(loaded, cfg)
    engine.add_request("ppl", ids, SamplingParams(max_tokens=1, ignore_eos=True))
    target = torch.tensor(ids[1:] + [0])
    nll, top1 = torch.zeros(len(ids)), torch.zeros(len(ids), dtype=torch.int64)
    while engine.has_work():
        capture: list = []
        engine.step(capture=capture)
        for _, pos, lg in capture:
            n = lg.shape[0]
            logp = F.log_softmax(lg.float(), dim=-1)
            nll[pos:pos + n] = -logp.gather(1, target[pos:pos + n, None])[:, 0]
            top1[pos:pos + n] = lg.argmax(-1)
    return Score(nll[:-1], top1[:-1])


def quantized(base: LoadedModel, mode: str) -> LoadedModel:
    """A copy of `base` (loaded unquantized) with `mode` applied."""
    if mode == "none":
        return base
    model = copy.deepcopy(base.model)
    ids = smooth.calibration_ids(base.tokenizer) if mode == "w8a8" else None
    quant.quantize_model(model, mode, calibration_ids=ids, measure=activation_maxima)
    out = copy.copy(base)
    out.model, out.quantization = model, mode
    return out


def decode_step_ms(loaded: LoadedModel, batch: int, steps: int) -> float:
    """Median engine step time with `batch` sequences decoding (short prompts, greedy)."""
    engine = Engine(loaded, EngineConfig(kv_cache_bytes=128 << 20, max_num_batched_tokens=256))
    for i in range(batch):
        engine.add_request(f"r{i}", [1 + i, 2, 3, 4], SamplingParams(max_tokens=steps + 4, ignore_eos=True))
    for _ in range(2):  # the prompts' prefill, then a first decode
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for i in range(batch):
        engine.abort(f"r{i}")
    engine.step()
    return sorted(times)[len(times) // 2] * 1e3


def matvec_gbps(dtype: torch.dtype = torch.bfloat16, nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Memory bandwidth of a matrix-vector product over `nbytes` of weights of `dtype` (the floor's yardstick:
    the model's dtype, so an fp32 model on a CPU without fast bf16 is not judged by a slow bf16 product)."""
    size = torch.tensor([], dtype=dtype).element_size()
    w = torch.randn(nbytes // size // 4096, 4096).to(dtype)
    x = torch.randn(1, 4096, dtype=dtype)
    F.linear(x, w)
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        F.linear(x, w)
        best = min(best, time.perf_counter() - t0)
    return w.numel() * size / best / 1e9


def run(modes: list[str], steps: int, chunk: int) -> dict:
    torch.manual_seed(0)
    base = load_model("default", quantization="none")
    ids = eval_ids(base)
    ref = score(base, ids, 4096)
    gbps = matvec_gbps(base.dtype)
    out: dict = {"model": base.model_id, "dtype": str(base.dtype).replace("torch.", ""),
                 "eval_tokens": len(ids),
                 "threads": torch.get_num_threads(), "matvec_gbps": round(gbps, 2), "modes": {}}
    for mode in modes:
        lm = quantized(base, mode)
        sc = ref if mode == "none" else score(lm, ids, chunk)
        wb = quant.weight_bytes(lm.model)
        row = {"weight_bytes": wb, "floor_ms": round(wb / gbps / 1e6, 2),
               "perplexity": round(sc.perplexity, 4), "ppl_ratio": round(sc.perplexity / ref.perplexity, 4),
               "top1_agreement": round((sc.top1 == ref.top1).float().mean().item(), 4)}
        for b in (1, 16):
            row[f"step_ms_b{b}"] = round(decode_step_ms(lm, b, steps), 2)
        row["b1_over_floor"] = round(row["step_ms_b1"] / row["floor_ms"], 2)
        out["modes"][mode] = row
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--modes", default="none,int8,int4,w8a8")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--chunk", type=int, default=4096,
                   help="prefill tokens per step when scoring (<= 24: packed kernels)")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    add_no_targets(p)
    args = p.parse_args(argv)
    res = run(args.modes.split(","), args.steps, args.chunk)
    res["cpu"], res["target_b1_over_floor"] = cpu_model(), TARGET_B1_OVER_FLOOR
    res["met"] = {f"{m}_b1_over_floor": row["b1_over_floor"] <= TARGET_B1_OVER_FLOOR
                  for m, row in res["modes"].items()}
    return emit(res, args.json, not args.no_targets)


if __name__ == "__main__":
    raise SystemExit(main())
