"""bench/disagg.py's pure parts: the seeded workload (Poisson long prompts, steady streams' prompts), the
per-request samples and their summary numbers (ITL, TTFT, window throughput, SLO goodput)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from config.loadtest.report import latency_stats_ms

VOCAB = (100, 40_000)  # token ids of the random prompts: clear of the special tokens at the bottom


@dataclass(slots=True)
class Workload:
    seed: int = 0
    duration_s: float = 180.0
    streams: int = 6  # steady streams, each restarting when done
    short_len: tuple[int, int] = (64, 128)
    # drawn per turn: streams of equal lengths would restart in lockstep and prefill together
    short_max_tokens: tuple[int, int] = (96, 160)
    stagger_s: float = 0.5  # stream s starts s x this after the window opens
    long_len: tuple[int, int] = (2048, 4096)
    long_max_tokens: int = 32
    # Poisson arrivals of long prompts: fp32 on one Zen 4 core prefills ~270 tokens/s, so one 3k-token prompt
    # every 15 s keeps the prefill worker ~75% busy and takes ~40% of the colocated arm's two cores
    long_mean_gap_s: float = 15.0


@dataclass(slots=True)
class Arrival:
    at_s: float  # offset from the start of the arm
    index: int  # the same long prompt in both arms
    length: int


@dataclass(slots=True)
class Sample:
    """One request as the client saw it: monotonic times, and per
    content chunk its arrival and token count."""

    kind: str  # "short" (a steady stream's request) or "long"
    index: int
    prompt_len: int
    start: float
    chunks: list[tuple[float, int]] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)  # completion tokens as the API renders them (logprobs)
    finish: str | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunks[0][0] - self.start if self.chunks else None

    @property
    def gaps(self) -> list[float]:
        return [b[0] - a[0] for a, b in zip(self.chunks, self.chunks[1:], strict=False)]

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunks)


@dataclass(slots=True)
class Slo:
    """DistServe-style SLOs: a request meets them when its TTFT and its
    own p99 inter-chunk gap are within bounds."""

    # defaults for fp32 on a Zen 4 core (docs/benchmarks.md): unloaded, a steady stream's TTFT is ~1 s and its
    # p99 gap ~0.14 s, and a lone prefill takes ~4 ms per prompt token
    ttft_short_s: float = 2.0
    ttft_long_base_s: float = 2.0
    ttft_long_per_token_s: float = 0.005  # a long prompt's TTFT bound: base + this x its prompt tokens
    itl_p99_s: float = 0.5

    def ttft_bound(self, sample: Sample) -> float:
        if sample.kind == "short":
            return self.ttft_short_s
        return self.ttft_long_base_s + self.ttft_long_per_token_s * sample.prompt_len

    def met(self, sample: Sample) -> bool:
        if not sample.ok or sample.ttft is None or sample.ttft > self.ttft_bound(sample):
            return False
        gaps = sample.gaps
        return not gaps or float(np.percentile(gaps, 99)) <= self.itl_p99_s


def rng_for(seed: int, *parts: object) -> random.Random:
    """A generator for one named draw (string seeds hash the same in every process and run)."""
    return random.Random(":".join(str(p) for p in (seed, *parts)))


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(length)]


def long_schedule(w: Workload) -> list[Arrival]:
    """Poisson arrivals over the arm's duration, each with a uniform length in `long_len`."""
    rng, out, t = rng_for(w.seed, "long-schedule"), [], 0.0
    while True:
        t += rng.expovariate(1.0 / w.long_mean_gap_s)
        if t >= w.duration_s:
            return out
        out.append(Arrival(round(t, 6), len(out), rng.randint(*w.long_len)))


def long_prompt(w: Workload, a: Arrival) -> list[int]:
    return random_prompt(rng_for(w.seed, "long", a.index), a.length)


def short_turn(w: Workload, stream: int, turn: int) -> tuple[list[int], int]:
    """Stream `stream`'s `turn`-th prompt and max_tokens: the same in both arms however many turns each gets
    through."""
    rng = rng_for(w.seed, "short", stream, turn)
    prompt = random_prompt(rng, rng.randint(*w.short_len))
    return prompt, rng.randint(*w.short_max_tokens)


def window_tokens(samples: list[Sample], t0: float, duration_s: float) -> int:
    """Completion tokens whose chunks arrived within [t0, t0 + duration_s]."""
    return sum(n for s in samples for at, n in s.chunks if t0 <= at <= t0 + duration_s)


def goodput(samples: list[Sample], slo: Slo, t0: float, duration_s: float) -> float:
    """Requests started within the window that met the SLOs, per second of the window."""
    return sum(slo.met(s) for s in samples if t0 <= s.start <= t0 + duration_s) / duration_s


def arm_numbers(samples: list[Sample], slo: Slo, t0: float, duration_s: float) -> dict:
    """One arm's raw numbers: steady streams' ITL and TTFT, long
    prompts' TTFT, throughput, goodput, errors."""
    short = [s for s in samples if s.kind == "short"]
    long_ = [s for s in samples if s.kind == "long"]
    errors = [s.error for s in samples if s.error is not None]
    chunks = [n for s in samples for _, n in s.chunks]
    tokens = window_tokens(samples, t0, duration_s)
    return {
        "short_requests": len(short), "long_requests": len(long_), "errors": len(errors),
        "error_examples": sorted(set(errors))[:3],
        "itl_ms": latency_stats_ms([g for s in short if s.ok for g in s.gaps]),
        "ttft_short_ms": latency_stats_ms([s.ttft for s in short if s.ok]),
        "ttft_long_ms": latency_stats_ms([s.ttft for s in long_ if s.ok]),
        "itl_long_ms": latency_stats_ms([g for s in long_ if s.ok for g in s.gaps]),
        "tokens_per_chunk": round(sum(chunks) / len(chunks), 3) if chunks else None,
        "window_output_tokens": tokens, "output_tok_s": round(tokens / duration_s, 3),
        "slo_met": sum(slo.met(s) for s in samples if t0 <= s.start <= t0 + duration_s),
        "slo_met_short": sum(slo.met(s) for s in short), "slo_met_long": sum(slo.met(s) for s in long_),
        "goodput_rps": round(goodput(samples, slo, t0, duration_s), 4),
    }


def greedy_compare(a: list[Sample], b: list[Sample]) -> dict:
    """The long prompts' outputs in two arms, token by token, by prompt index (both must have finished)."""
    left = {s.index: s for s in a if s.kind == "long" and s.ok}
    right = {s.index: s for s in b if s.kind == "long" and s.ok}
    both = sorted(left.keys() & right.keys())
    differ = {i: next((k for k, (x, y) in enumerate(zip(left[i].tokens, right[i].tokens,
                                                        strict=False)) if x != y),
                      min(len(left[i].tokens), len(right[i].tokens)))
              for i in both if left[i].tokens != right[i].tokens}
    return {"compared": len(both), "identical": len(both) - len(differ),
            "tokens": sum(min(len(left[i].tokens), len(right[i].tokens)) for i in both),
            "first_difference": {str(i): k for i, k in differ.items()}}


def ratio(new: float | None, base: float | None) -> float | None:
    return round(new / base, 4) if new is not None and base else None


LOWER_BETTER = {"itl_p99_ratio": ("itl_ms", "p99"), "itl_p50_ratio": ("itl_ms", "p50"),
                "ttft_p50_ratio": ("ttft_long_ms", "p50"), "ttft_short_p50_ratio": ("ttft_short_ms", "p50")}


def ratios(dis: dict, co: dict) -> dict[str, float | None]:
    """The disaggregated arm's figures over one colocated arm's."""
    p = {k: ratio(dis[f][s], co[f][s]) for k, (f, s) in LOWER_BETTER.items()}
    p["throughput_ratio"] = ratio(dis["output_tok_s"], co["output_tok_s"])
    p["goodput_ratio"] = ratio(dis["goodput_rps"], co["goodput_rps"])
    return p


def against_best(by_chunk: dict[str, dict[str, float | None]]) -> dict[str, float | None]:
    """Each ratio against the colocated chunk best at it (lower-is-better ratios: the largest over the chunks,
    throughput and goodput: the smallest); a ratio missing at any chunk is missing."""
    out: dict[str, float | None] = {}
    for k in next(iter(by_chunk.values())):
        values = [r[k] for r in by_chunk.values()]
        out[k] = None if None in values else (max if k in LOWER_BETTER else min)(values)
    return out
