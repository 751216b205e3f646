"""Organizations, their projects (today's tenants) and each level's dollar budget, as operators edit them."""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis
import redis.asyncio as aredis

from admission.money.keys import (
    DEFAULT_ORG,
    LEVELS,
    ORGS_SET,
    PERIODS,
    PROJECT_ORG_KEY,
    balance_key,
    config_key,
    model_ident,
    spend_key,
    usd_to_micro,
    user_ident,
    validate_org,
)
from admission.money.live_hash import LiveHash
from tenancy.schema import TENANTS_SET

DIRECTORY_REFRESH_S = 1.0
ROLLING_BUCKETS = {3600: 24, 86_400: 30}  # a rolling window's bucket seconds -> buckets (money_reserve.lua)


@dataclass(slots=True, frozen=True)
class BudgetSetting:
    """One level's budget: micro-dollars per period (0: unlimited)."""

    budget_micro: int
    period: str


def _text(v: str | bytes | None) -> str | None:
    return v.decode() if isinstance(v, bytes) else v


def migrate_projects(r: redis.Redis) -> list[str]:
    """Make every tenant without an organization a project of the default one; return those it moved."""
    moved = []
    for name in sorted(_text(n) or "" for n in r.smembers(TENANTS_SET)):
        if r.hsetnx(PROJECT_ORG_KEY, name, DEFAULT_ORG):
            moved.append(name)
    r.sadd(ORGS_SET, DEFAULT_ORG)
    return moved


def assign_project(r: redis.Redis, project: str, org: str) -> None:
    """Put a project into an organization (its balances start afresh under the new organization's tag)."""
    r.sadd(ORGS_SET, validate_org(org))
    r.hset(PROJECT_ORG_KEY, project, org)


def project_org(r: redis.Redis, project: str) -> str:
    return _text(r.hget(PROJECT_ORG_KEY, project)) or DEFAULT_ORG


def set_budget(r: redis.Redis, org: str, level: str, ident: str, usd: str, period: str = "month",
               *, user_default: bool = False, model: str | None = None) -> BudgetSetting:
    """Set a level's budget in USD per `period`; `user_default` sets a project's limit for each end user,
    `model` an organization's or project's budget for that model alone."""
    if period not in PERIODS:
        raise ValueError(f"period must be day, month, 24h or 30d, not {period!r}")
    micro = usd_to_micro(usd, "budget")
    cfg, prefix = _config(org, level, ident, user_default, model)
    r.hset(cfg, mapping={prefix + "budget_micro": micro, prefix + "period": period})
    return BudgetSetting(micro, period)


def set_limits(r: redis.Redis, org: str, level: str, ident: str, *, tpm: int | None = None,
               rpm: int | None = None, max_concurrent: int | None = None, user_default: bool = False,
               model: str | None = None) -> dict[str, int]:
    """Set a level's token and request rates and concurrency (0: none; None: unchanged); return them all.
    A project's own rates are its tenant record's (`switchyard tenants`): here a project takes them only per
    end user (`user_default`) or per model."""
    if level == "project" and not user_default and model is None:
        raise ValueError("a project's tpm, rpm and max_concurrent are its tenant record's "
                         "(switchyard tenants set); here give a model or set them per user")
    cfg, prefix = _config(org, level, ident, user_default, model)
    fields = {name: value for name, value in (("tpm", tpm), ("rpm", rpm), ("max_concurrent", max_concurrent))
              if value is not None}
    for name, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, not {value!r}")
    if fields:
        r.hset(cfg, mapping={prefix + k: v for k, v in fields.items()})
    raw = r.hmget(cfg, *(prefix + k for k in ("tpm", "rpm", "max_concurrent")))
    return {k: int(v or 0) for k, v in zip(("tpm", "rpm", "max_concurrent"), raw, strict=True)}


def _config(org: str, level: str, ident: str, user_default: bool, model: str | None) -> tuple[str, str]:
    """(config hash, field prefix) of a level's limits, checked."""
    if level not in LEVELS or level == "user":
        raise ValueError(f"level must be one of organization, project, key, not {level!r}")
    if level == "organization" and ident != org:
        raise ValueError(f"an organization's limits are its own: ident {ident!r} is not {org!r}")
    if user_default and level != "project":
        raise ValueError("per-user default limits belong to a project")
    if model is not None and (level == "key" or user_default):
        raise ValueError("per-model limits belong to an organization or a project")
    org = validate_org(org)
    if model is not None:
        scope = "org_model" if level == "organization" else "project_model"
        return config_key(org, scope, model_ident(ident, model)), ""
    return config_key(org, level, ident), "user_" if user_default else ""


def copy_key_budget(r: redis.Redis, project: str, old_digest: str, new_digest: str) -> bool:
    """Give a rotated key's successor the old key's budget config (its spend starts afresh); False when the
    old key has none."""
    org = project_org(r, project)
    fields = r.hgetall(config_key(org, "key", old_digest))
    if fields:
        r.hset(config_key(org, "key", new_digest), mapping=fields)
    return bool(fields)


def read_balance(r: redis.Redis, org: str, level: str, ident: str, project: str = "") -> dict[str, int]:
    """A level's settled spend and in-flight holds of its current period (as last written); for a rolling
    window, the spend of its buckets now in it."""
    if level == "user":
        ident = user_ident(project, ident)
    key = balance_key(org, level, ident)
    period, spent, held = (_text(v) for v in r.hmget(key, "p", "spent", "held"))
    if period and period.startswith("R"):
        size = int(period[1:])
        last = int(time.time()) // size
        buckets = r.hmget(key, [f"r:{last - j}" for j in range(ROLLING_BUCKETS[size])])
        spent = str(sum(int(v or 0) for v in buckets))
    return {"spent_micro": int(spent or 0), "held_micro": int(held or 0)}


def read_spend(r: redis.Redis, org: str, days: int = 7) -> dict[str, dict[str, int]]:
    """The organization's recorded spend per UTC day (today first): `<dimension>|<counter>` -> value."""
    now = time.time()
    out = {}
    for i in range(max(1, days)):
        day = time.strftime("%Y%m%d", time.gmtime(now - i * 86_400))
        raw = r.hgetall(spend_key(org, day))
        out[day] = {_text(k) or "": int(v) for k, v in raw.items()}
    return out


class OrgDirectory:
    """A gateway's project -> organization map, re-read from Redis when older than 1 s."""

    def __init__(self, client: aredis.Redis, refresh_s: float = DIRECTORY_REFRESH_S) -> None:
        self._orgs = LiveHash(client, PROJECT_ORG_KEY, _org_map, refresh_s)

    async def org_of(self, project: str) -> str:
        return (await self._orgs.value()).get(project, DEFAULT_ORG)


def _org_map(raw: dict) -> dict[str, str]:
    return {_text(k) or "": _text(v) or DEFAULT_ORG for k, v in raw.items()}
