"""The peers' side-by-side load generator (`../shared/peers/loadgen.py`) with more workloads: `long`
(prompts of about 2-3k tokens of its random-word vocabulary, 256 out) and natural-text twins of its
three (`nmixed`, `nprefix`, `nsingle`), whose prompts are passages of the Python Language Reference
shipped with every CPython (`pydoc_data.topics`, ~65k words of English prose with code), so greedy
continuations do not repeat the way random-word prompts make them, and `ntrace`: such passages with prompt
and output lengths drawn from the Azure LLM inference trace 2023's conversation service
(`bench/data/azure_llm_conv_2023.csv`: median 1,027 prompt and 133 output tokens). Same protocol, fields and
JSON line; a stream short of its `max_tokens` is an error here, and the prompts' SHA-256 goes to stderr
(`prompts_sha256 HEX`) so that two sides' prompts can be compared. A load generator (for bench/vs_peer.py):
no targets.

Run as a script with the peer's python (stdlib and httpx only):
`long_loadgen.py PEER_LOADGEN --workload long ...`.
"""

import asyncio
import hashlib
import importlib.util
import json
import random
import sys
from pathlib import Path

LONG_WORDS = (1600, 2400)
LONG_OUT = 256
PREFIX_WORDS = 1400  # ~2,150 tokens of the default model's tokenizer: the shared, cached part of `nprefix`
NATURAL = ("nmixed", "nprefix", "nsingle", "ntrace")
TRACE = Path(__file__).resolve().parent / "data" / "azure_llm_conv_2023.csv"
TOKENS_PER_WORD = 1.5  # the default model's tokenizer over this corpus: 1.34-1.70, mean 1.50
TRACE_MAX_PROMPT, TRACE_MAX_OUT = 3000, 600  # tokens: within a 4,096-token context (10% and 1% clipped)


def corpus_words() -> list[str]:
    """The Python Language Reference's topics in a fixed order, as words (the same on every CPython 3.11+)."""
    import pydoc_data.topics as topics

    return " ".join(topics.topics[k] for k in sorted(topics.topics)).split()


def passage(words: list[str], rng: random.Random, n: int) -> str:
    start = rng.randrange(len(words) - n)
    return " ".join(words[start:start + n])


def trace_lengths() -> list[tuple[int, int]]:
    """The trace sample's (prompt, output) token counts, clipped to TRACE_MAX_PROMPT and TRACE_MAX_OUT."""
    rows = [line.split(",") for line in TRACE.read_text().splitlines() if line and not line.startswith("#")]
    return [(max(1, min(int(c), TRACE_MAX_PROMPT)), max(1, min(int(g), TRACE_MAX_OUT)))
            for c, g in rows if c.isdigit()]


def trace_draw(n: int, rng: random.Random) -> list[tuple[int, int]]:
    """`n` pairs spread evenly over the sample ordered by prompt length (so that even a small workload has the
    trace's length distribution, not a lucky or unlucky draw), in a seeded random order."""
    pairs = sorted(trace_lengths())
    picked = [pairs[int((i + 0.5) * len(pairs) / n)] for i in range(n)]
    rng.shuffle(picked)
    return picked


def natural(name: str, n: int, seed: int) -> list[tuple[str, int]]:
    """The shared generator's workload shapes (lengths and outputs) over passages of natural text; `ntrace`
    takes each request's lengths from the trace sample (`trace_draw`)."""
    words, rng = corpus_words(), random.Random(seed)
    if name == "ntrace":
        return [(passage(words, rng, max(1, round(c / TOKENS_PER_WORD))), g) for c, g in trace_draw(n, rng)]
    if name == "nmixed":
        return [(passage(words, rng, rng.randint(32, 512)), rng.randint(16, 192)) for _ in range(n)]
    if name == "nprefix":
        system = "You are a careful assistant. Answer from the reference below.\n\n"
        system += passage(words, random.Random(7), PREFIX_WORDS)
        return [(f"{system}\n\nQuestion: {passage(words, rng, rng.randint(10, 30))}\nAnswer:", 24)
                for _ in range(n)]
    return [(passage(words, rng, 200), 128) for _ in range(n)]


def main() -> None:
    path, sys.argv = sys.argv[1], [sys.argv[0], *sys.argv[2:]]
    spec = importlib.util.spec_from_file_location("peer_loadgen", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    shared = peer.workload

    def workload(name: str, n: int, seed: int) -> list:
        if name in NATURAL:
            return natural(name, n, seed)
        if name != "long":
            return shared(name, n, seed)
        rng = random.Random(seed)
        return [(peer.text(rng, rng.randint(*LONG_WORDS)), LONG_OUT) for _ in range(n)]

    def digested(name: str, n: int, seed: int) -> list:
        reqs = workload(name, n, seed)
        print(f"prompts_sha256 {prompts_sha256(reqs)}", file=sys.stderr, flush=True)
        return reqs

    peer.workload = digested
    peer.one = checked(peer.one)
    asyncio.run(peer.main())


def prompts_sha256(reqs: list) -> str:
    """One digest of a workload's (prompt, max_tokens) pairs, to show two sides were sent the same."""
    return hashlib.sha256(json.dumps(reqs).encode()).hexdigest()


def checked(one):  # noqa: ANN001, ANN201 - the shared generator's untyped coroutine
    """The shared generator's request, where a stream that ends short of its `max_tokens` counts as an error
    (every request asks for `ignore_eos`, so a short one was cut or refused, never finished)."""

    async def run(client, args, prompt, max_tokens, out):  # noqa: ANN001
        await one(client, args, prompt, max_tokens, out)
        if out and "error" not in out[-1] and out[-1]["out"] != max_tokens:
            out[-1] = {"error": "short", "body": f"{out[-1]['out']} of {max_tokens} tokens"}

    return run


if __name__ == "__main__":
    main()
