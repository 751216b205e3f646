"""How tenants live in Redis: key layout, config fields with their defaults, and the `Tenant` record.

One tenant's keys share the hash tag `{t:<name>}` (Cluster-safe scripts); plain field names let
operators edit quotas with `redis-cli HSET`.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from common.priorities import MAX_WEIGHT, PRIORITY_NAMES, Priority

log = logging.getLogger("switchyard.tenancy")

ACTIVE, DISABLED = "active", "disabled"
INTERACTIVE, BATCH = Priority.INTERACTIVE, Priority.BATCH  # stored in a config hash by `.label`
STATUSES = (ACTIVE, DISABLED)
PRIORITIES = PRIORITY_NAMES

# Integer quota fields of the config hash and their defaults (0 = unlimited for tpm/rpm/max_concurrent).
INT_DEFAULTS: dict[str, int] = {
    "tpm": 100_000,
    "rpm": 600,
    "max_concurrent": 16,
    "max_tokens": 4096,
    "default_max_tokens": 256,
    "ttft_slo_ms": 0,  # time-to-first-token target of the tenant's requests (ms); 0: its class's default
}
STR_DEFAULTS: dict[str, str] = {"status": ACTIVE, "priority": INTERACTIVE.label, "allowed_models": "*"}
DEFAULT_WEIGHT = 1.0  # `weight`: relative fair share on a worker, in (0, MAX_WEIGHT]

# Single-key records, spread over Redis Cluster slots on purpose (no script or transaction spans two):
TENANTS_SET = "sy:tenants"          # set of tenant names (for `tenants list`)
API_KEY_PREFIX = "sy:key:"          # sy:key:<sha256 hex> -> hash {tenant, prefix, created_at, ...}
GATEWAYS_KEY = "{sy:gateways}"      # sorted set of live gateway ids scored by expiry (ms); its own hash tag
LEGACY_GATEWAYS_KEY = "sy:gateways"  # its name before Redis Cluster support (`switchyard redis migrate-keys`)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def validate_name(name: str) -> str:
    """Return `name` if it is a valid tenant name, else raise ValueError."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"invalid tenant name {name!r}: use 1-64 letters, digits, '_', '.', '-' (starting alphanumeric)")
    return name


def tag(name: str) -> str:
    return "{t:" + name + "}"


def config_key(name: str) -> str:
    return tag(name) + ":config"


def bucket_key(name: str) -> str:
    """Hash holding both token buckets: `tok`, `req` levels and their common timestamp `ts` (µs)."""
    return tag(name) + ":bucket"


def leases_key(name: str) -> str:
    return tag(name) + ":leases"


def tenant_keys_key(name: str) -> str:
    """Set of the SHA-256 digests of this tenant's API keys."""
    return tag(name) + ":keys"


def usage_key(name: str, day: str) -> str:
    """Per-day metering hash; `day` is `YYYYMMDD` (UTC)."""
    return tag(name) + ":usage:" + day


def api_key_key(digest: str) -> str:
    return API_KEY_PREFIX + digest


@dataclass(slots=True, frozen=True)
class Tenant:
    """A tenant's config as the gateway sees it (parsed from `{t:<name>}:config`)."""

    name: str
    status: str = ACTIVE
    priority: Priority = INTERACTIVE
    tpm: int = INT_DEFAULTS["tpm"]
    rpm: int = INT_DEFAULTS["rpm"]
    max_concurrent: int = INT_DEFAULTS["max_concurrent"]
    max_tokens: int = INT_DEFAULTS["max_tokens"]
    default_max_tokens: int = INT_DEFAULTS["default_max_tokens"]
    ttft_slo_ms: int = INT_DEFAULTS["ttft_slo_ms"]  # 0: the priority class's default (gateway settings)
    allowed_models: tuple[str, ...] | None = None  # None: every model
    weight: float = DEFAULT_WEIGHT  # relative fair share on a worker
    salt: str = ""
    created_at: float = 0.0

    @property
    def active(self) -> bool:
        return self.status == ACTIVE

    def allows_model(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models

    def effective_priority(self, requested: Priority | None) -> Priority:
        """The request's priority capped by the tenant's class (a batch tenant never gets interactive)."""
        if self.priority == BATCH or requested == BATCH:
            return BATCH
        return INTERACTIVE


AT_LEAST_ONE = frozenset({"max_tokens", "default_max_tokens"})  # token counts a request is capped at


def parse_int_field(name: str, raw: str | bytes | None) -> int:
    """Parse a non-negative integer quota field; missing or malformed values give the default.

    Mirrors the Lua scripts' `tonumber` handling so that both sides agree on the limits.
    """
    default = INT_DEFAULTS[name]
    if raw is None or raw == "" or raw == b"":
        return default
    try:
        value = float(raw)
    except (TypeError, ValueError):
        log.warning("tenant config field %s is not a number; using default %d", name, default)
        return default
    if value != value or value < 0 or value == float("inf"):
        return default
    if name in AT_LEAST_ONE and value < 1:  # written past the CLI: every request would fail at the worker
        log.warning("tenant config field %s is %s (below 1); using default %d", name, raw, default)
        return default
    return int(value)


def parse_weight(raw: str | bytes | None) -> float:
    """The fair-share weight; missing, malformed or out of (0, MAX_WEIGHT] gives the default (1)."""
    if raw is None or raw == "" or raw == b"":
        return DEFAULT_WEIGHT
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = math.nan
    if not 0 < value <= MAX_WEIGHT:
        log.warning("tenant config field weight %r is not a number in (0, %g]; using 1", raw, MAX_WEIGHT)
        return DEFAULT_WEIGHT
    return value


def parse_models(raw: str) -> tuple[str, ...] | None:
    raw = raw.strip()
    if raw in ("", "*"):
        return None
    return tuple(m.strip() for m in raw.split(",") if m.strip())


def _text(value: str | bytes | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def parse_tenant(name: str, fields: dict) -> Tenant:
    """Build a `Tenant` from a raw config hash (bytes or str keys/values)."""
    f = {_text(k): _text(v) for k, v in fields.items()}
    status = f.get("status") or ACTIVE
    if status not in STATUSES:
        status = DISABLED  # an unknown status must not grant access
    try:
        priority = Priority.parse(f.get("priority") or INTERACTIVE.label)
    except ValueError:
        priority = BATCH  # an unknown class gets the lower one
    try:
        created_at = float(f.get("created_at") or 0.0)
    except ValueError:
        created_at = 0.0
    return Tenant(
        name=name,
        status=status,
        priority=priority,
        allowed_models=parse_models(f.get("allowed_models") or "*"),
        weight=parse_weight(f.get("weight")),
        salt=f.get("salt") or "",
        created_at=created_at,
        **{k: parse_int_field(k, f.get(k)) for k in INT_DEFAULTS},
    )


KEY_FIELDS = ("tenant", "models", "expires_at")  # what a gateway reads of a key's record


@dataclass(slots=True, frozen=True)
class KeyRecord:
    """What a gateway knows of one API key: its tenant, model scope and expiry."""

    tenant: str
    models: tuple[str, ...] | None = None  # None: every model its tenant may use
    expires_at: float | None = None  # unix seconds; None: never

    def live(self, now: float) -> bool:
        return self.expires_at is None or now < self.expires_at

    def scoped(self, tenant: Tenant) -> Tenant:
        """The tenant as this key sees it: the key's models narrow the tenant's allow-list, never widen it."""
        if self.models is None:
            return tenant
        allowed = tenant.allowed_models
        models = self.models if allowed is None else tuple(m for m in self.models if m in allowed)
        return replace(tenant, allowed_models=models)


def parse_expiry(raw: str | None) -> float | None:
    """`expires_at` in unix seconds: absent, empty or 0 is never; a malformed value has expired (fails
    closed)."""
    if raw is None or not raw.strip():
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if value != value or value == -math.inf:
        log.warning("API key field expires_at %r is not a number; the key is refused", raw)
        return 0.0
    return None if value in (0, math.inf) else value


def parse_key_record(values: Sequence[str | bytes | None]) -> KeyRecord | None:
    """A key's record from the values of `KEY_FIELDS` (None: no such key)."""
    tenant, models, expires = (_text(v) for v in values)
    if tenant is None:
        return None
    return KeyRecord(tenant, parse_models(models or "*"), parse_expiry(expires))
