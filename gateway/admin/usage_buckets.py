"""Usage and costs pages in OpenAI's shape from the per-day spend ledger (the one place computing them)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass

import redis.asyncio as aredis

from admission import spend_key, user_ident
from gateway.admin.admin_query import DAY_S, UsageQuery, page_token

Ledger = dict[str, dict[str, int]]  # UTC day "YYYYMMDD" -> spend fields `<dimension>|<counter>` -> value
COUNTERS = ("cost_micro", "requests", "input_tokens", "cached_tokens", "output_tokens")
_GROUP_FIELD = {"project_id": "project", "api_key_id": "key", "model": "model", "user_id": "user",
                "line_item": "model"}
_FILTER_FIELD = {"project_ids": "project", "api_key_ids": "key", "models": "model", "user_ids": "user",
                 "line_items": "model"}


@dataclass(slots=True, frozen=True)
class Cell:
    """One combination the ledger records: project, key digest, model and end user (None: no `user`)."""

    project: str
    key: str
    model: str
    user: str | None


def day_of(epoch_s: int) -> str:
    return time.strftime("%Y%m%d", time.gmtime(epoch_s))


def parse_cell(dimension: str) -> Cell | None:
    """`p:<p>|k:<digest>|m:<model>[|u:<p>/<user>]` (other dimensions: None)."""
    if not dimension.startswith("p:") or "|k:" not in dimension:
        return None
    project, _, rest = dimension[2:].partition("|k:")
    key, sep, rest = rest.partition("|m:")
    if not sep:
        return None
    model, user = rest, None
    at = rest.rfind("|u:")
    if at >= 0:
        model, user = rest[:at], rest[at + 3:].partition("/")[2]
    return Cell(project, key, model, user)


def cells(fields: dict[str, int]) -> dict[Cell, Counter]:
    """A day's spend per combination (every served request is in exactly one)."""
    out: dict[Cell, Counter] = {}
    for name, value in fields.items():
        dim, _, counter = name.rpartition("|")
        cell = parse_cell(dim)
        if cell is not None and counter in COUNTERS:
            out.setdefault(cell, Counter())[counter] += int(value)
    return out


def _wanted(query: UsageQuery, cell: Cell) -> bool:
    for name, values in query.filters:
        have = getattr(cell, _FILTER_FIELD[name])
        if name == "user_ids":
            values = frozenset(user_ident("", v).partition("/")[2] for v in values)
        if have not in values:
            return False
    return True


def results(query: UsageQuery, fields: dict[str, int]) -> list[dict]:
    """One bucket's results: a row per group (one row without `group_by`; none without usage)."""
    groups: dict[tuple, Counter] = {}
    for cell, counts in cells(fields).items():
        if _wanted(query, cell):
            key = tuple(getattr(cell, _GROUP_FIELD[g]) for g in query.group_by)
            groups.setdefault(key, Counter()).update(counts)
    rows = []
    for key, counts in sorted(groups.items(), key=lambda kv: tuple(str(v) for v in kv[0])):
        named = dict(zip(query.group_by, key, strict=True))
        row = _completions_row if query.kind == "completions" else _costs_row
        rows.append(row(named, counts))
    return rows


def _completions_row(named: dict[str, str | None], c: Counter) -> dict:
    return {"object": "organization.usage.completions.result", "input_tokens": c["input_tokens"],
            "output_tokens": c["output_tokens"], "input_cached_tokens": c["cached_tokens"],
            "input_uncached_tokens": c["input_tokens"] - c["cached_tokens"], "input_audio_tokens": 0,
            "output_audio_tokens": 0, "num_model_requests": c["requests"],
            "project_id": named.get("project_id"), "user_id": named.get("user_id"),
            "api_key_id": named.get("api_key_id"), "model": named.get("model"), "batch": None,
            "service_tier": None}


def _costs_row(named: dict[str, str | None], c: Counter) -> dict:
    return {"object": "organization.costs.result",
            "amount": {"value": c["cost_micro"] / 1_000_000, "currency": "usd"},
            "line_item": named.get("line_item"), "project_id": named.get("project_id"),
            "api_key_id": named.get("api_key_id"), "user_id": named.get("user_id"), "quantity": None,
            "quantity_unit": None}


def build_page(query: UsageQuery, ledger: Ledger) -> dict:
    """The page of buckets `query` asks for, from the spend of each of its days."""
    data = [{"object": "bucket", "start_time": start, "end_time": start + DAY_S,
             "results": results(query, ledger.get(day_of(start), {}))} for start in query.bucket_starts()]
    more = query.has_more
    return {"object": "page", "data": data, "has_more": more,
            "next_page": page_token(query.page + query.limit * DAY_S) if more else None}


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


async def read_ledger(client: aredis.Redis, orgs: list[str], query: UsageQuery) -> Ledger:
    """The spend of the query's page, summed over `orgs` (each organization keeps its own day hashes)."""
    days = [day_of(s) for s in query.bucket_starts()]
    keys = [(day, spend_key(org, day)) for day in days for org in orgs]
    replies = await asyncio.gather(*(client.hgetall(k) for _, k in keys))
    out: Ledger = {day: {} for day in days}
    for (day, _), raw in zip(keys, replies, strict=True):
        merged = out[day]
        for k, v in raw.items():
            merged[_text(k)] = merged.get(_text(k), 0) + int(v)
    return out
