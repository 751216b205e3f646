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
BATCH = "batch"  # `<model>:batch`: the fraction of its prices a Batch API request pays (0-1; none: 1)
FULL_PPM = 1_000_000
DEFAULT_MODEL = "*"  # the price of a model with none of its own
REFRESH_S = 1.0


@dataclass(slots=True, frozen=True)
class Price:
    """Micro-dollars per million input, cached-input and output tokens (integers: exact sums), and the part
    of them, in millionths, that a Batch API request pays."""

    input: int = 0
    cached: int = 0
    output: int = 0
    batch_ppm: int = FULL_PPM

    def cost(self, input_tokens: int, cached_tokens: int, output_tokens: int, batch: bool = False) -> int:
        """Exact cost in micro-dollars, rounded up once: cached tokens at the cached price."""
        cached = min(max(0, cached_tokens), max(0, input_tokens))
        total = (input_tokens - cached) * self.input + cached * self.cached + output_tokens * self.output
        return self._round(total, batch)

    def max_cost(self, prompt_tokens: int, max_tokens: int, batch: bool = False) -> int:
        """The most `cost` can be for this request, whatever part of the prompt turns out cached."""
        per_input = max(self.input, self.cached)
        return self._round(prompt_tokens * per_input + max_tokens * self.output, batch)

    def _round(self, total: int, batch: bool) -> int:
        """`total` (micro-dollars x tokens per million) in micro-dollars, rounded up once."""
        if batch:
            return -(-(total * self.batch_ppm) // (1_000_000 * FULL_PPM))
        return -(-total // 1_000_000)


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


def parse_prices(raw: dict) -> dict[str, Price]:
    """`sy:prices` parsed; a malformed field is logged and read as 0; cached defaults to input."""
    fields: dict[str, dict[str, int]] = {}
    for k, v in raw.items():
        model, _, kind = _text(k).rpartition(":")
        if kind == BATCH and model:
            fields.setdefault(model, {})[kind] = _batch_ppm(_text(v), model)
            continue
        if kind not in KINDS or not model:
            continue
        try:
            fields.setdefault(model, {})[kind] = usd_to_micro(_text(v), f"price {model}:{kind}")
        except ValueError as exc:
            log.warning("%s; reading it as 0", exc)
            fields.setdefault(model, {})[kind] = 0
    return {m: Price(f.get("input", 0), f.get("cached", f.get("input", 0)), f.get("output", 0),
                     f.get(BATCH, FULL_PPM)) for m, f in fields.items()}


def _batch_ppm(text: str, model: str) -> int:
    """A batch fraction (0-1) in millionths; a malformed one is logged and read as 1 (no discount)."""
    try:
        ppm = usd_to_micro(text, f"batch fraction {model}")
    except ValueError as exc:
        log.warning("%s; reading it as 1", exc)
        return FULL_PPM
    if ppm > FULL_PPM:
        log.warning("batch fraction %s of %s is over 1; reading it as 1", text[:20], model)
        return FULL_PPM
    return ppm


def set_price(r: redis.Redis, model: str, input_usd: str, cached_usd: str | None, output_usd: str,
              batch: str | None = None) -> Price:
    """Write one model's prices (USD per million tokens); `cached_usd` None charges cached tokens as input;
    `batch`, the fraction of them a Batch API request pays (0-1), None keeps it as it is."""
    values = {"input": input_usd, "output": output_usd}
    if cached_usd is not None:
        values["cached"] = cached_usd
    for kind, v in values.items():
        usd_to_micro(v, f"price {kind}")  # validate before writing anything
    if batch is not None:
        if usd_to_micro(batch, "batch fraction") > FULL_PPM:
            raise ValueError(f"batch fraction {batch!r} must be between 0 and 1")
        values[BATCH] = batch
    r.hset(PRICES_KEY, mapping={f"{model}:{k}": str(v) for k, v in values.items()})
    if cached_usd is None:
        r.hdel(PRICES_KEY, f"{model}:cached")
    return parse_prices(r.hgetall(PRICES_KEY))[model]


def list_prices(r: redis.Redis) -> dict[str, dict[str, str]]:
    """Every model's prices as exact USD strings per million tokens."""
    return {m: {**{k: micro_to_usd(getattr(p, k)) for k in KINDS}, BATCH: micro_to_usd(p.batch_ppm)}
            for m, p in sorted(parse_prices(r.hgetall(PRICES_KEY)).items())}


class PriceBook:
    """A gateway's view of the prices, refreshed from Redis when older than REFRESH_S."""

    def __init__(self, client: aredis.Redis, refresh_s: float = REFRESH_S) -> None:
        self._prices = LiveHash(client, PRICES_KEY, parse_prices, refresh_s)

    async def get(self, model: str) -> Price:
        prices = await self._prices.value()
        return prices.get(model) or prices.get(DEFAULT_MODEL) or Price()
