"""N-gram speculative decoding on a repetitive workload: TPOT with
speculation on vs off, same prompts, greedy.

The prompts ask the model to copy a passage with one change, so answers repeat spans of the prompt.
A measurement with no targets of its own (TPOT ratio, acceptance, identical text): it exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bench.machine import cpu_model
from worker.config import EngineConfig
from worker.engine.core import Engine
from worker.model.loader import LoadedModel, load_model
from worker.protocol import SamplingParams

PASSAGES = [
    ("The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night the "
     "keeper climbed the narrow stairs, trimmed the wick and watched the ships pass safely through the dark "
     "water. When the storms came, the light never failed, and the sailors told stories about the keeper who "
     "never slept.",
     "keeper", "guardian"),
    ("def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n        subtotal += "
     "item.price * item.quantity\n    tax = subtotal * tax_rate\n    return subtotal + tax\n\n\ndef "
     "print_receipt(items, tax_rate):\n    for item in items:\n        print(item.name, item.price * "
     "item.quantity)\n    print('total', total_price(items, tax_rate))\n", "items", "products"),
    ("Our team meets every Monday at nine in the small conference room on the third floor. Please bring your "
     "weekly report, your list of open questions and any blockers you have found. If you cannot attend the "
     "meeting, send your report to the team lead before Monday morning.", "Monday", "Tuesday"),
    ("To make the bread, mix the flour, the salt and the yeast in a large bowl. Add the warm water slowly "
     "and knead the dough for ten minutes until it is smooth. Let the dough rise for one hour, shape it into "
     "a loaf and bake it for forty minutes.", "dough", "batter"),
]


# open-ended questions: answers copy little of the prompt (what
# speculation costs when drafts are mostly wrong)
FREE = ["Write a short story about a fox who learns to fly.", "Explain why the sky is blue to a child.",
        "Give three tips for learning a new language.", "Describe your ideal weekend in a few sentences.",
        "What are the pros and cons of working from home?", "Invent a recipe that uses apples and cheese.",
        "Write a haiku sequence about winter mornings.",
        "Summarize the plot of a detective novel you invent."]


def prompts(loaded: LoadedModel, n: int, workload: str = "repetitive") -> list[list[int]]:
    out = []
    for i in range(n):
        if workload == "free":
            msg = FREE[i % len(FREE)]
        else:
            text, old, new = PASSAGES[i % len(PASSAGES)]
            msg = (f"Repeat the following passage exactly, changing only the word '{old}' to '{new}' "
                   "everywhere."
                   f"\n\n{text}")
        out.append(loaded.tokenizer.apply_chat_template([{"role": "user", "content": msg}]))
    return out


def run_batch(engine: Engine, batch: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[float]]:
    """All prompts at once; per request its output and TPOT (first to last token / (tokens - 1))."""
    sp = SamplingParams(max_tokens=max_tokens)
    rids = [f"r{i}" for i in range(len(batch))]
    for rid, p in zip(rids, batch, strict=True):
        engine.add_request(rid, p, sp)
    toks: dict[str, list[int]] = {r: [] for r in rids}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    while engine.has_work():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.new_tokens:
                toks[o.rid].extend(o.new_tokens)
                first.setdefault(o.rid, now)
                last[o.rid] = now
    tpot = [(last[r] - first[r]) * 1e3 / (len(toks[r]) - 1) for r in rids if len(toks[r]) > 1]
    return [toks[r] for r in rids], tpot


def measure(loaded: LoadedModel, batch: int, rounds: int, max_tokens: int, workload: str) -> dict:
    ps = prompts(loaded, batch, workload)
    engines = {on: Engine(loaded, EngineConfig(kv_cache_bytes=256 << 20, enable_prefix_cache=False,
                                               spec_tokens=4 if on else 0, spec_max_batch=max(4, batch)))
               for on in (True, False)}
    tpot: dict[bool, list[float]] = {True: [], False: []}
    tok_s: dict[bool, list[float]] = {True: [], False: []}
    texts: dict[bool, list[list[int]]] = {}
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):  # alternate: the machine's load drifts
            t0 = time.perf_counter()
            out, t = run_batch(engines[on], ps, max_tokens)
            tok_s[on].append(sum(len(x) for x in out) / (time.perf_counter() - t0))
            tpot[on].append(statistics.median(t))
            texts.setdefault(on, out)
    s = engines[True].stats()
    on_ms, off_ms = statistics.median(tpot[True]), statistics.median(tpot[False])
    return {"tpot_ms_on": round(on_ms, 2), "tpot_ms_off": round(off_ms, 2),
            "tpot_ratio": round(on_ms / off_ms, 3),
            "acceptance_rate": round(s.spec_acceptance_rate, 3),
            "tokens_per_step": round(s.spec_tokens_per_step, 3),
            "out_tok_s_ratio": round(statistics.median(tok_s[True]) / statistics.median(tok_s[False]), 3),
            "identical_text": texts[True] == texts[False],
            "output_tokens": sum(len(t) for t in texts[False])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--batches", default="1,4", help="comma-separated batch sizes")
    ap.add_argument("--rounds", type=int, default=3, help="on/off pairs per batch size (medians)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--workload", default="repetitive", choices=["repetitive", "free"])
    ap.add_argument("--quantization", default="none", choices=["none", "int8", "int4", "w8a8", "auto"])
    ap.add_argument("--dtype", default=None)
    args = ap.parse_args(argv)
    loaded = load_model("default", dtype=args.dtype, quantization=args.quantization)
    result = {"bench": "spec_decode", "model": loaded.model_id, "cpu": cpu_model(),
              "threads": torch.get_num_threads(),
              "dtype": str(loaded.dtype).replace("torch.", ""), "quantization": loaded.quantization,
              "workload": args.workload, "spec_tokens": 4, "batches": {}}
    for b in (int(x) for x in args.batches.split(",")):
        result["batches"][str(b)] = measure(loaded, b, args.rounds, args.max_tokens, args.workload)
        print(f"batch {b}: {result['batches'][str(b)]}", file=sys.stderr, flush=True)
    first = result["batches"][args.batches.split(",")[0]]
    result |= {"tpot_ratio": first["tpot_ratio"], "acceptance_rate": first["acceptance_rate"],
               "tokens_per_step": first["tokens_per_step"],
               "identical_text": all(v["identical_text"] for v in result["batches"].values())}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
