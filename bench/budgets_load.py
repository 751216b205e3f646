"""The budgets bench's clients (streaming chats, random max_tokens, cancellations) and admission timings."""

from __future__ import annotations

import asyncio
import json
import random
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import httpx

WORDS = ("budget", "ledger", "river", "stone", "orbit", "lantern", "copper", "meadow", "signal", "harbor")
_USED = re.compile(r"\(\$([0-9.]+) used or held\)")
BLOCKS = 5  # admission timings: p99 per block of consecutive samples, the median block reported


@dataclass(slots=True, frozen=True)
class Prices:
    """USD per million tokens, as the bench set them (exact fractions: no float rounding)."""

    input: str
    cached: str
    output: str

    def cost_micro(self, prompt: int, cached: int, completion: int) -> int:
        """The documented cost: ceil((uncached x input + cached x cached + output x output) / 1e6) micro-USD,
        prices in micro-USD per million tokens; computed here independently of the admission code."""
        cached = min(max(0, cached), prompt)
        total = ((prompt - cached) * Fraction(self.input) + cached * Fraction(self.cached)
                 + completion * Fraction(self.output)) * 1_000_000
        return -(-total.numerator // (total.denominator * 1_000_000))

    def max_cost_micro(self, prompt: int, max_tokens: int) -> int:
        dearer = max(Fraction(self.input), Fraction(self.cached))
        total = (prompt * dearer + max_tokens * Fraction(self.output)) * 1_000_000
        return -(-total.numerator // (total.denominator * 1_000_000))


@dataclass(slots=True)
class Outcome:
    """One request as its client saw it; `user` is its own `user` id (its per-request spend dimension)."""

    user: str
    project: str
    max_tokens: int
    kind: str  # completed | cancelled | refused (insufficient_quota) | error
    status: int = 0
    usage: dict | None = None
    chunks: int = 0  # content chunks received
    detail: str = ""


def usage_cost(prices: Prices, usage: dict) -> int:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return prices.cost_micro(usage["prompt_tokens"], cached, usage["completion_tokens"])


class Load:
    """`clients` coroutines over the gateways, each looping requests until `stop` is set."""

    def __init__(self, gateways: list[str], keys: list[tuple[str, str]], clients: int, max_tokens: int,
                 cancel_frac: float, seed: int, on_refusal: Callable[[str], None]) -> None:
        self.gateways, self.keys, self.clients = gateways, keys, clients
        self.max_tokens, self.cancel_frac = max_tokens, cancel_frac
        self.rng = random.Random(seed)
        self.on_refusal = on_refusal
        self.stop = asyncio.Event()
        self.outcomes: list[Outcome] = []
        self.first_refusal_used_usd: str | None = None

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=self.clients * 2)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            await asyncio.gather(*(self._client(http, c) for c in range(self.clients)))

    async def _client(self, http: httpx.AsyncClient, c: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            project, key = self.keys[self.rng.randrange(len(self.keys))]
            gateway = self.gateways[(c + n) % len(self.gateways)]
            max_tokens = self.rng.randint(1, self.max_tokens)
            cancel_after = (self.rng.randint(1, max_tokens - 1)
                            if max_tokens > 1 and self.rng.random() < self.cancel_frac else None)
            words = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(2, 12)))
            out = Outcome(f"c{c}r{n}", project, max_tokens, "error")
            try:
                await self._one(http, gateway, key, words, out, cancel_after)
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                out.kind, out.detail = "error", type(exc).__name__
            self.outcomes.append(out)
            if out.kind in ("refused", "error"):
                await asyncio.sleep(0.02)  # a refused client backs off a little, as a real one would

    async def _one(self, http: httpx.AsyncClient, gateway: str, key: str, words: str, out: Outcome,
                   cancel_after: int | None) -> None:
        body = {"model": "default", "messages": [{"role": "user", "content": f"Tell me about {words}."}],
                "max_tokens": out.max_tokens, "ignore_eos": True, "temperature": 1.0, "stream": True,
                "stream_options": {"include_usage": True}, "user": out.user}
        headers = {"authorization": f"Bearer {key}"}
        async with http.stream("POST", gateway + "/v1/chat/completions", json=body, headers=headers) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                err = resp.json().get("error") or {}
                out.detail = str(err.get("code") or err.get("type") or resp.status_code)
                if out.detail == "insufficient_quota":
                    out.kind = "refused"
                    if self.first_refusal_used_usd is None:
                        m = _USED.search(err.get("message", ""))
                        self.first_refusal_used_usd = m.group(1) if m else None
                    self.on_refusal(err.get("message", ""))
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.kind, out.detail = "error", str(event["error"].get("code"))
                    return
                if event.get("usage"):
                    out.usage = event["usage"]
                if any((ch.get("delta") or {}).get("content") for ch in event.get("choices") or []):
                    out.chunks += 1
                    if cancel_after is not None and out.chunks >= cancel_after:
                        out.kind = "cancelled"  # leaving the block closes the connection mid-stream
                        return
            out.kind = "completed" if out.usage is not None else "error"


def p99(samples: list[float]) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, len(s) * 99 // 100)]


async def admission_latency(url: str, api_key: str, project: str, samples: int) -> dict:
    """p50/p99 (ms) of one request's admission calls against `url`, the two paths alternating sample by
    sample: flat = authenticate + token reserve + token settle (the tenant path without `money_budgets`);
    four-level = the same plus the money hold and settle of the organization -> project -> key -> user path,
    each beside its token call as the gateway runs them, through the gateway's own objects
    (`TenantDirectory`, `Budget`, `MoneyGate`). The samples fall into
    BLOCKS consecutive blocks; a path's p99 is the median of its blocks' p99s and the overhead the median of
    the blocks' differences, so one burst of a shared machine's noise does not decide the figure."""
    from admission import Budget
    from admission.money.money_gate import MoneyGate
    from tenancy import TenantDirectory, async_client
    from tenancy.apikeys import digest

    client = async_client(url)
    directory, budget, money = TenantDirectory(client), Budget(client), MoneyGate(client, 900.0)
    key_digest = digest(api_key)

    async def flat() -> None:
        tenant = await directory.authenticate(api_key)
        assert tenant is not None
        res = await budget.reserve(tenant, 20, 16)
        res.record(completion_tokens=16)
        await budget.settle(res)

    async def four(i: int) -> None:  # as the gateway does it (gateway/flow/money_step.py): side by side
        tenant = await directory.authenticate(api_key)
        assert tenant is not None
        res, hold = await asyncio.gather(budget.reserve(tenant, 20, 16),
                                         money.hold(project, key_digest, "default", f"lat-{i % 64}", 20, 16))
        res.record(completion_tokens=16)
        await asyncio.gather(money.settle(hold, True, 20, 0, 16), budget.settle(res))

    times: dict[str, list[list[float]]] = {"flat": [[] for _ in range(BLOCKS)],
                                           "four_level": [[] for _ in range(BLOCKS)]}
    try:
        for i in range(-50, samples):  # 50 warm-up pairs: connections, scripts, caches
            for name in ("flat", "four_level") if i % 2 else ("four_level", "flat"):
                t0 = time.perf_counter()
                await (flat() if name == "flat" else four(i))
                if i >= 0:
                    times[name][i * BLOCKS // samples].append((time.perf_counter() - t0) * 1000)
    finally:
        await client.aclose()
    blocks = {k: [p99(b) for b in v] for k, v in times.items()}
    out = {f"{k}_p99_ms": round(statistics.median(v), 3) for k, v in blocks.items()}
    out.update({f"{k}_p50_ms": round(statistics.median([x for b in v for x in b]), 3)
                for k, v in times.items()})
    diffs = [f - g for f, g in zip(blocks["four_level"], blocks["flat"], strict=True)]
    out["p99_overhead_ms"] = round(statistics.median(diffs), 3)
    out["samples"] = samples
    return out
