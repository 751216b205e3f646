"""Strict query parameters of the administration API: every unknown or unsupported one is a 400 naming it."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.web.api_errors import ApiError, invalid

DAY_S = 86_400
Pairs = Iterable[tuple[str, str]]

# OpenAI parameters Switchyard's ledger cannot answer (refused by name, never ignored)
REFUSED = {
    "batch": "the ledger does not tell batch requests apart",
    "api_source": "the ledger has no API source",
}
USAGE_GROUPS = {"completions": ("project_id", "api_key_id", "model", "user_id"),
                "costs": ("project_id", "api_key_id", "user_id", "line_item")}
USAGE_FILTERS = {"completions": ("project_ids", "api_key_ids", "models", "user_ids"),
                 "costs": ("project_ids", "api_key_ids", "line_items")}
USAGE_LIMITS = {"completions": (7, 31), "costs": (7, 180)}  # (default, most) buckets of 1d
REFUSED_GROUPS = {"batch", "service_tier", "api_source"}


@dataclass(slots=True, frozen=True)
class UsageQuery:
    """A usage or costs query: day buckets [first, end_time), `limit` of them from `page`."""

    kind: str                                 # "completions" or "costs"
    start_time: int
    end_time: int
    limit: int
    page: int                                 # start of the page's first bucket (epoch seconds)
    group_by: tuple[str, ...] = ()
    filters: tuple[tuple[str, frozenset[str]], ...] = ()

    def bucket_starts(self) -> list[int]:
        last = min(self.end_time, self.page + self.limit * DAY_S)
        return list(range(self.page, last, DAY_S))

    @property
    def has_more(self) -> bool:
        return self.page + self.limit * DAY_S < self.end_time

    def filter(self, name: str) -> frozenset[str] | None:
        return dict(self.filters).get(name)


def split_params(pairs: Pairs, scalars: Iterable[str],
                 lists: Iterable[str] = ()) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Scalars once each, lists as `name[]=` (the SDK's form) or repeated `name=`; anything else: 400."""
    scalars, lists = set(scalars), set(lists)
    one: dict[str, str] = {}
    many: dict[str, list[str]] = {}
    for name, value in pairs:
        base = name[:-2] if name.endswith("[]") else name
        if base in lists:
            many.setdefault(base, []).append(value)
        elif base in scalars and base == name:
            if base in one:
                raise invalid(f"Parameter '{base}' is given more than once.", param=base)
            one[base] = value
        elif base in REFUSED:
            raise invalid(f"Parameter '{base}' is not supported: {REFUSED[base]}.", param=base,
                          code="unsupported_parameter")
        else:
            raise invalid(f"Unknown parameter '{name}'.", param=name, code="unknown_parameter")
    return one, many


def int_param(one: dict[str, str], name: str, default: int | None, lo: int, hi: int) -> int:
    raw = one.get(name)
    if raw is None:
        if default is None:
            raise invalid(f"Missing required parameter '{name}'.", param=name,
                          code="missing_required_parameter")
        return default
    if not raw.strip().isdigit() or not lo <= int(raw) <= hi:
        raise invalid(f"'{name}' must be an integer from {lo} to {hi}, not {raw[:40]!r}.", param=name)
    return int(raw)


def bool_param(one: dict[str, str], name: str) -> bool:
    raw = one.get(name, "false").lower()
    if raw not in ("true", "false"):
        raise invalid(f"'{name}' must be true or false.", param=name)
    return raw == "true"


def parse_usage_query(pairs: Pairs, kind: str, now: float | None = None) -> UsageQuery:
    """`GET /v1/organization/usage/completions` (kind "completions") or `/v1/organization/costs` ("costs")."""
    filters = USAGE_FILTERS[kind]
    one, many = split_params(pairs, ("start_time", "end_time", "bucket_width", "limit", "page"),
                             ("group_by", *filters))
    now_s = int(time.time() if now is None else now)
    start = int_param(one, "start_time", None, 0, 2**40)
    end = int_param(one, "end_time", max(now_s, start + 1), 1, 2**40)
    if end <= start:
        raise invalid("'end_time' must be after 'start_time'.", param="end_time")
    _check_width(one.get("bucket_width", "1d"))
    default, most = USAGE_LIMITS[kind]
    limit = int_param(one, "limit", default, 1, most)
    first = start - start % DAY_S
    page = _page(one.get("page"), first, end)
    group_by = tuple(dict.fromkeys(_groups(many.get("group_by", []), kind)))
    chosen = tuple((f, frozenset(many[f])) for f in filters if f in many)
    return UsageQuery(kind, start, end, limit, page, group_by, chosen)


def _check_width(width: str) -> None:
    if width == "1d":
        return
    why = ("the ledger records usage per UTC day" if width in ("1m", "1h")
           else "the widths are 1m, 1h and 1d")
    raise invalid(f"bucket_width '{width[:20]}' is not supported ({why}): use 1d.", param="bucket_width",
                  code="unsupported_parameter")


def _groups(values: list[str], kind: str) -> list[str]:
    allowed = USAGE_GROUPS[kind]
    for v in values:
        if v not in allowed:
            why = "is not supported by Switchyard's ledger" if v in REFUSED_GROUPS else "is not a grouping"
            raise invalid(f"group_by '{v[:40]}' {why}; use {', '.join(allowed)}.", param="group_by")
    return values


def page_token(start: int) -> str:
    return f"page_{start}"


def _page(token: str | None, first: int, end: int) -> int:
    if token is None:
        return first
    raw = token.removeprefix("page_")
    if not raw.isdigit() or int(raw) % DAY_S or not first <= int(raw) < end:
        raise invalid(f"'page' {token[:40]!r} is not a cursor of this query: pass its next_page.",
                      param="page")
    return int(raw)


def list_object(items: list[dict], one: dict[str, str]) -> dict:
    """An OpenAI list of `items` (each with an `id`) after the `after` cursor, at most `limit` (1-100)."""
    limit = int_param(one, "limit", 20, 1, 100)
    after = one.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise ApiError(400, f"No object with id '{after[:80]}' to list after.", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
