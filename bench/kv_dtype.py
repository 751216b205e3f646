"""8-bit KV pages against the model dtype's, same process: quality, decode step time at 2k context, capacity.

Quality is perplexity and top-1 agreement on `tests/data/quant_eval.txt` through the engine's paged prefill;
the decode step is one forward of `rows` sequences at `context` tokens (pages filled with random K/V), the two
KV dtypes alternating, the median of `reps` each; capacity is the tokens the same byte budget holds.
The line names its baseline (`baseline_kv_dtype`: the model dtype, fp32 on AVX2-only CPUs, where the ratios
look about twice as good as against bf16) and the CPU (`cpu`, `cpu_flags`); exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Iterator

import torch

from bench.machine import add_no_targets, cpu_model, emit, machine_fields
from bench.quant_decode import eval_ids, quantized, score
from worker.config import EngineConfig
from worker.engine.core import Engine
from worker.kernels.cpu_features import describe
from worker.kvcache.tensors import KVCache, bytes_per_page, num_pages_for
from worker.model.attention import BatchLayout
from worker.model.llama import StepContext
from worker.model.loader import LoadedModel, load_model
from worker.model.prefill_choice import PATH_ENV, sdpa_wins
from worker.quant.weights import resolve_mode

TARGETS = {"ppl_ratio": 1.005, "decode_step_ratio_2k": 0.65, "capacity_ratio": 1.9}


def fill_random(kv: KVCache, seed: int = 0) -> None:
    """Pages of plausible K/V: normal rows (int8: a full range of codes at scale 0.02)."""
    g = torch.Generator().manual_seed(seed)
    for t in kv.k + kv.v:
        if kv.quantized:
            t.copy_(torch.randint(-127, 128, t.shape, generator=g, dtype=torch.int8))
        else:
            t.copy_(torch.randn(t.shape, generator=g))
    for s in kv.k_scale + kv.v_scale:
        s.fill_(0.02)


def decode_engine(loaded: LoadedModel, kv_dtype: str, rows: int, context: int) -> Engine:
    bs = 16
    pages = rows * -(-(context + 1) // bs) + 1
    budget = pages * bytes_per_page(loaded.config, loaded.dtype, bs, kv_dtype)
    engine = Engine(loaded, EngineConfig(block_size=bs, kv_cache_bytes=budget, kv_dtype=kv_dtype))
    fill_random(engine.runner.kv)
    return engine


def step_fn(engine: Engine, rows: int, context: int):
    """One decode forward of `rows` sequences at `context` tokens each (distinct pages), prepare included."""
    runner, bs = engine.runner, engine.config.block_size
    per = -(-(context + 1) // bs)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(rows)]
    slots = torch.tensor([t[context // bs] * bs + context % bs for t in tables])
    lay = BatchLayout(bs, slots, tables, [context + 1] * rows, [], [], [])
    ids, pos, out_rows = torch.ones(rows, dtype=torch.int64), torch.full((rows,), context), torch.arange(rows)

    def step() -> None:
        with torch.inference_mode():
            ctx = StepContext(pos, out_rows, runner.attn, runner.attn.prepare(lay, runner.device), runner.kv,
                              runner.ops, runner.stack)
            runner.model(ids, ctx)

    return step


def step_ratio(loaded: LoadedModel, rows: int, context: int, reps: int) -> dict:
    steps = {d: step_fn(decode_engine(loaded, d, rows, context), rows, context) for d in ("model", "int8")}
    times: dict[str, list[float]] = {"model": [], "int8": []}
    for _ in range(2):
        for fn in steps.values():
            fn()
    for _ in range(reps):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    return {"step_ms_model": round(med["model"], 2), "step_ms_int8": round(med["int8"], 2),
            "ratio": round(med["int8"] / med["model"], 4)}


def capacity(loaded: LoadedModel) -> dict:
    cfg = EngineConfig()  # the default CPU budget
    n = {d: num_pages_for(loaded.config, cfg, loaded.dtype, loaded.device, d) * cfg.block_size
         for d in ("model", "int8")}
    return {"capacity_tokens_model": n["model"], "capacity_tokens_int8": n["int8"],
            "capacity_ratio": round(n["int8"] / n["model"], 4)}


@contextlib.contextmanager
def _prefill_path(path: str) -> Iterator[None]:
    saved = os.environ.get(PATH_ENV)
    os.environ[PATH_ENV] = path
    try:
        yield
    finally:
        if saved is None:
            del os.environ[PATH_ENV]
        else:
            os.environ[PATH_ENV] = saved


def quality(loaded: LoadedModel, chunk: int) -> dict:
    """Both KV dtypes through the C++ prefill kernels, so that the ratio is what 8-bit storage costs; and the
    model-dtype pages as a worker runs them (on a CPU with AMX, prefill on SDPA:
    `worker.model.prefill_choice`)."""
    ids = eval_ids(loaded)
    with _prefill_path("kernel"):
        ref, got = score(loaded, ids, chunk), score(loaded, ids, chunk, kv_dtype="int8")
    served = score(loaded, ids, chunk) if sdpa_wins(loaded.config, loaded.dtype, 16) else ref
    return {"eval_tokens": len(ids), "ppl_model": round(ref.perplexity, 4),
            "ppl_int8": round(got.perplexity, 4), "ppl_ratio": round(got.perplexity / ref.perplexity, 5),
            "top1_agreement": round((got.top1 == ref.top1).float().mean().item(), 4),
            "ppl_model_served": round(served.perplexity, 4)}


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    base = load_model("default", dtype=args.dtype, quantization="none")
    mode = resolve_mode(args.quantization, base.device)
    loaded = quantized(base, mode)
    dtype = str(loaded.dtype).replace("torch.", "")
    # the baseline is model-dtype pages: fp32 on AVX2-only CPUs (where
    # ratios look twice as good), bf16 elsewhere
    res: dict = {"bench": "kv_dtype", "cpu": cpu_model(), "cpu_flags": describe(), "model": loaded.model_id,
                 "dtype": dtype, "baseline_kv_dtype": dtype, "quantization": mode,
                 "threads": torch.get_num_threads(), "rows": args.rows, "context": args.context}
    res |= quality(loaded, args.chunk)
    steps = step_ratio(loaded, args.rows, args.context, args.reps)
    res |= {"step_ms_model_2k": steps["step_ms_model"], "step_ms_int8_2k": steps["step_ms_int8"],
            "decode_step_ratio_2k": steps["ratio"]}
    res |= capacity(loaded)
    res["targets_met"] = {"ppl_ratio": res["ppl_ratio"] <= TARGETS["ppl_ratio"],
                          "decode_step_ratio_2k":
                              res["decode_step_ratio_2k"] <= TARGETS["decode_step_ratio_2k"],
                          "capacity_ratio": res["capacity_ratio"] >= TARGETS["capacity_ratio"]}
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dtype", default=None, help="model dtype (default: the loader's pick for this CPU)")
    p.add_argument("--quantization", default="auto",
                   help="weights: auto (the worker's default), none, int8, ...")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--reps", type=int, default=9, help="timed steps per KV dtype (median)")
    p.add_argument("--chunk", type=int, default=4096, help="prefill tokens per step when scoring")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    add_no_targets(p)
    args = p.parse_args(argv)
    load = os.getloadavg()
    res = run(args) | machine_fields(load)
    return emit(res, args.json, not args.no_targets)


if __name__ == "__main__":
    raise SystemExit(main())
