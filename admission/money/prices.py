"""Per-model prices in Redis (USD per million tokens), read by every gateway at most 1 s old."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis
import redis.asyncio as aredis

from admission.money.keys import PRICES_KEY, micro_to_usd, usd_to_micro
from admission.money.live_hash import LiveHash

log = logging.getLogger("switchyard.admission")

KINDS = ("input", "cached", "output")
DEFAULT_MODEL = "*"  # the price of a model with none of its own
REFRESH_S = 1.0


@dataclass(slots=True, frozen=True)
class Price:
    """Micro-dollars per million input, cached-input and output tokens (integers: exact sums)."""

    input: int = 0
    cached: int = 0
    output: int = 0

    def cost(self, input_tokens: int, cached_tokens: int, output_tokens: int) -> int:
        """Exact cost in micro-dollars, rounded up once: cached tokens at the cached price."""
        cached = min(max(0, cached_tokens), max(0, input_tokens))
        total = (input_tokens - cached) * self.input + cached * self.cached + output_tokens * self.output
        return -(-total // 1_000_000)

    def max_cost(self, prompt_tokens: int, max_tokens: int) -> int:
        """The most `cost` can be for this request, whatever part of the prompt turns out cached."""
        per_input = max(self.input, self.cached)
        return -(-(prompt_tokens * per_input + max_tokens * self.output) // 1_000_000)


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


def parse_prices(raw: dict) -> dict[str, Price]:
    """`sy:prices` parsed; a malformed field is logged and read as 0; cached defaults to input."""
    fields: dict[str, dict[str, int]] = {}
    for k, v in raw.items():
        model, _, kind = _text(k).rpartition(":")
        if kind not in KINDS or not model:
            continue
        try:
            fields.setdefault(model, {})[kind] = usd_to_micro(_text(v), f"price {model}:{kind}")
        except ValueError as exc:
            log.warning("%s; reading it as 0", exc)
            fields.setdefault(model, {})[kind] = 0
    return {m: Price(f.get("input", 0), f.get("cached", f.get("input", 0)), f.get("output", 0))
            for m, f in fields.items()}


def set_price(r: redis.Redis, model: str, input_usd: str, cached_usd: str | None, output_usd: str) -> Price:
    """Write one model's prices (USD per million tokens); `cached_usd` None charges cached tokens as input."""
    values = {"input": input_usd, "output": output_usd}
    if cached_usd is not None:
        values["cached"] = cached_usd
    for kind, v in values.items():
        usd_to_micro(v, f"price {kind}")  # validate before writing anything
    r.hset(PRICES_KEY, mapping={f"{model}:{k}": str(v) for k, v in values.items()})
    if cached_usd is None:
        r.hdel(PRICES_KEY, f"{model}:cached")
    return parse_prices(r.hgetall(PRICES_KEY))[model]


def list_prices(r: redis.Redis) -> dict[str, dict[str, str]]:
    """Every model's prices as exact USD strings per million tokens."""
    return {m: {k: micro_to_usd(getattr(p, k)) for k in KINDS}
            for m, p in sorted(parse_prices(r.hgetall(PRICES_KEY)).items())}


class PriceBook:
    """A gateway's view of the prices, refreshed from Redis when older than REFRESH_S."""

    def __init__(self, client: aredis.Redis, refresh_s: float = REFRESH_S) -> None:
        self._prices = LiveHash(client, PRICES_KEY, parse_prices, refresh_s)

    async def get(self, model: str) -> Price:
        prices = await self._prices.value()
        return prices.get(model) or prices.get(DEFAULT_MODEL) or Price()
