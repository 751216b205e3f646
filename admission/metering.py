"""Reads the per-tenant, per-day usage counters the settle script writes (for `switchyard usage`)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import redis

from tenancy.schema import usage_key, validate_name

FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")


@dataclass(slots=True, frozen=True)
class DayUsage:
    day: str  # YYYY-MM-DD (UTC)
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def read_usage(r: redis.Redis, tenant: str, days: int = 7, today: dt.date | None = None) -> list[DayUsage]:
    """Usage of `tenant` for the `days` UTC days ending today, oldest first (one pipelined round trip)."""
    validate_name(tenant)
    if not 1 <= days <= 400:
        raise ValueError("days must be between 1 and 400")
    today = today or dt.datetime.now(dt.UTC).date()
    dates = [today - dt.timedelta(days=i) for i in range(days - 1, -1, -1)]
    pipe = r.pipeline(transaction=False)
    for d in dates:
        pipe.hmget(usage_key(tenant, d.strftime("%Y%m%d")), *FIELDS)
    out = []
    for d, values in zip(dates, pipe.execute(), strict=True):
        out.append(DayUsage(d.isoformat(), *(int(v or 0) for v in values)))
    return out
