"""Structured-output cost: output tokens/s with a `response_format`
JSON schema vs without, same prompts, same run.

Target: `ratio` (constrained over unconstrained tok/s) >= 0.8; exits 1 when missed. `--json` prints one line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.machine import add_no_targets, cpu_model, exit_code
from worker.config import EngineConfig
from worker.engine.core import Engine
from worker.model.loader import LoadedModel, load_model
from worker.protocol import SamplingParams, json_schema_spec

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "city", "skills", "role"],
    "additionalProperties": False,
}
JOBS = ("baker", "pilot", "teacher", "nurse", "farmer", "painter", "chemist", "judge")


def prompts(loaded: LoadedModel, n: int) -> list[list[int]]:
    tok = loaded.tokenizer
    return [tok.apply_chat_template([{"role": "user",
                                      "content": f"Describe a {JOBS[i % len(JOBS)]} number {i} "
                                      "as JSON with name, age, city, skills and role."}]) for i in range(n)]


def run(loaded: LoadedModel, ids: list[list[int]], max_tokens: int,
        grammar: dict | None) -> tuple[int, float]:
    """All prompts at once, seeded sampling at temperature 1; (output tokens, wall seconds)."""
    engine = Engine(loaded, EngineConfig(kv_cache_bytes=512 << 20))
    try:
        for i, p in enumerate(ids):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i,
                                                          grammar=grammar, ignore_eos=grammar is None))
        t0 = time.perf_counter()
        n = 0
        while engine.has_work():
            n += sum(len(o.new_tokens) for o in engine.step())
        return n, time.perf_counter() - t0
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto", help="auto (the worker's choice) | bfloat16 | float32")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    add_no_targets(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=None if args.dtype == "auto" else args.dtype)
    ids = prompts(loaded, args.requests)
    grammar = json_schema_spec(SCHEMA).to_dict()
    run(loaded, ids[:2], 4, grammar)  # warm-up: the grammar tokenizer, first compile, kernels
    # Unconstrained first gets a token budget equal to what the constrained run produces, so both runs do
    # the same number of steps at the same batch sizes.
    n_con, t_con = run(loaded, ids, args.max_tokens, grammar)
    per_req = max(1, round(n_con / len(ids)))
    n_free, t_free = run(loaded, ids, per_req, None)
    result = {"bench": "structured", "requests": len(ids), "tokens_constrained": n_con,
              "tokens_unconstrained": n_free, "tok_s_constrained": round(n_con / t_con, 1),
              "tok_s_unconstrained": round(n_free / t_free, 1),
              "ratio": round((n_con / t_con) / (n_free / t_free), 3), "target_ratio": 0.8,
              "device": str(loaded.device), "cpu": cpu_model(),
              "dtype": str(loaded.dtype).removeprefix("torch.")}
    result["met"] = {"ratio": result["ratio"] >= result["target_ratio"]}
    if not args.json:
        for k, v in result.items():
            print(f"{k:>22}: {v}", file=sys.stderr)
    print(json.dumps(result))
    return exit_code(result, not args.no_targets)


if __name__ == "__main__":
    raise SystemExit(main())
