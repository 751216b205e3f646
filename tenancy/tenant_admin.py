"""Operator-side tenant and API key management over a blocking Redis client (CLI, tests, `make run`).

Writes the same config hash an operator's `redis-cli HSET` would; plaintext keys are returned once, never
stored.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, replace

import redis

from common.priorities import MAX_WEIGHT, Priority
from tenancy import apikeys
from tenancy.schema import (
    ACTIVE,
    API_KEY_PREFIX,
    AT_LEAST_ONE,
    DISABLED,
    INT_DEFAULTS,
    PRIORITIES,
    STATUSES,
    TENANTS_SET,
    Tenant,
    api_key_key,
    config_key,
    parse_expiry,
    parse_models,
    parse_tenant,
    tenant_keys_key,
    validate_name,
)
from tenancy.tenancy_errors import AmbiguousKeyPrefix, KeyNotFound, TenancyError, TenantExists, TenantNotFound

SETTABLE_FIELDS = (*INT_DEFAULTS, "priority", "allowed_models", "status", "weight")
_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(slots=True, frozen=True)
class KeyInfo:
    """What is stored about one API key (never the key itself)."""

    digest: str
    tenant: str
    prefix: str
    created_at: float
    models: tuple[str, ...] | None = None  # None: every model its tenant may use
    expires_at: float | None = None  # unix seconds; None: never

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


def validate_fields(fields: dict[str, object]) -> dict[str, str]:
    """Check operator-supplied config fields and render them as hash values; None values are skipped."""
    out: dict[str, str] = {}
    for name, value in fields.items():
        if value is None:
            continue
        if name not in SETTABLE_FIELDS:
            raise TenancyError(f"unknown tenant field {name!r}; settable: {', '.join(SETTABLE_FIELDS)}")
        if name in INT_DEFAULTS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TenancyError(f"{name} must be a non-negative integer, got {value!r}")
            if name in AT_LEAST_ONE and value < 1:
                raise TenancyError(f"{name} must be at least 1 (a request may always ask for a token), "
                                   f"got {value}")
            out[name] = str(value)
        elif name == "priority":
            label = value.label if isinstance(value, Priority) else value
            if label not in PRIORITIES:
                raise TenancyError(f"priority must be one of {', '.join(PRIORITIES)}, got {value!r}")
            out[name] = str(label)
        elif name == "status":
            if value not in STATUSES:
                raise TenancyError(f"status must be one of {', '.join(STATUSES)}, got {value!r}")
            out[name] = str(value)
        elif name == "weight":
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_WEIGHT:
                raise TenancyError(f"weight must be a number in (0, {MAX_WEIGHT:g}], got {value!r}")
            out[name] = repr(float(value))
        else:
            out[name] = _models_value(value)
    return out


def _models_value(value: object, what: str = "allowed_models") -> str:
    items = value if isinstance(value, list | tuple) else str(value).split(",")
    models = [str(m).strip() for m in items if str(m).strip()]
    if not models:
        raise TenancyError(f"{what} must be '*' or a comma-separated list of model ids")
    if "*" in models:
        return "*"
    return ",".join(models)


def create_tenant(r: redis.Redis, name: str, **fields: object) -> Tenant:
    """Create tenant `name` with the given quota fields (defaults for the rest) and a fresh salt."""
    validate_name(name)
    values = validate_fields(fields)
    key = config_key(name)
    if not r.hsetnx(key, "salt", apikeys.new_salt()):
        raise TenantExists(f"tenant {name!r} already exists")
    values.setdefault("status", ACTIVE)
    values["created_at"] = f"{time.time():.3f}"
    pipe = r.pipeline(transaction=False)
    pipe.hset(key, mapping=values)
    pipe.sadd(TENANTS_SET, name)
    pipe.execute()
    return get_tenant(r, name)


def get_tenant(r: redis.Redis, name: str) -> Tenant:
    fields = r.hgetall(config_key(validate_name(name)))
    if not fields:
        raise TenantNotFound(f"no tenant named {name!r}")
    return parse_tenant(name, fields)


def update_tenant(r: redis.Redis, name: str, **fields: object) -> Tenant:
    """Change some config fields of an existing tenant; takes effect on every gateway within 1 s."""
    values = validate_fields(fields)
    get_tenant(r, name)  # raises TenantNotFound
    if values:
        r.hset(config_key(name), mapping=values)
    return get_tenant(r, name)


def set_status(r: redis.Redis, name: str, active: bool) -> Tenant:
    return update_tenant(r, name, status=ACTIVE if active else DISABLED)


def list_tenants(r: redis.Redis) -> list[tuple[Tenant, int]]:
    """Every registered tenant with its number of live API keys, sorted by name."""
    names = sorted(n.decode() for n in r.smembers(TENANTS_SET))
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(config_key(name))
        pipe.scard(tenant_keys_key(name))
    replies = pipe.execute()
    out = []
    for i, name in enumerate(names):
        fields, nkeys = replies[2 * i], replies[2 * i + 1]
        if fields:
            out.append((parse_tenant(name, fields), int(nkeys)))
    return out


def issue_key(r: redis.Redis, name: str, *, models: object = None, expires_at: float | None = None) -> str:
    """Make a new API key for tenant `name`, scoped to `models` (None or '*': every model its tenant may use)
    and valid until `expires_at` (unix seconds; None: never); the returned plaintext is the only copy."""
    get_tenant(r, name)
    fields = {}
    if models is not None and _models_value(models, "models") != "*":
        fields["models"] = _models_value(models, "models")
    if expires_at is not None:
        fields["expires_at"] = _expiry_value(expires_at)
    return _store_key(r, name, fields)


def _expiry_value(expires_at: float) -> str:
    number = isinstance(expires_at, int | float) and not isinstance(expires_at, bool)
    if not number or not math.isfinite(expires_at) or expires_at <= 0:
        raise TenancyError(f"expires_at must be a positive number of unix seconds, got {expires_at!r}")
    return f"{expires_at:.3f}"


def _store_key(r: redis.Redis, name: str, fields: dict[str, str]) -> str:
    key = apikeys.new_api_key()
    dig = apikeys.digest(key)
    pipe = r.pipeline(transaction=False)
    pipe.hset(api_key_key(dig), mapping={
        **fields, "tenant": name, "prefix": apikeys.display_prefix(key), "created_at": f"{time.time():.3f}"})
    pipe.sadd(tenant_keys_key(name), dig)
    pipe.execute()
    return key


def rotate_key(r: redis.Redis, name: str, old: str, grace_s: float,
               expires_at: float | None = None) -> tuple[str, KeyInfo]:
    """Issue tenant `name` a new key with the record of its key `old` (display prefix, whole key or digest):
    its model scope and other fields; `old` keeps working for `grace_s` more seconds (never longer than it
    would have). Returns the new key (the only copy) and the old key's record with its new expiry."""
    if isinstance(grace_s, bool) or not isinstance(grace_s, int | float) or not 0 <= grace_s < math.inf:
        raise TenancyError(f"grace must be a non-negative number of seconds, got {grace_s!r}")
    info = find_key(r, old, name)
    fields = {k.decode(): v.decode() for k, v in r.hgetall(api_key_key(info.digest)).items()}
    for own in ("tenant", "prefix", "created_at", "expires_at", "rotated_from"):
        fields.pop(own, None)
    fields["rotated_from"] = info.digest
    if expires_at is not None:
        fields["expires_at"] = _expiry_value(expires_at)
    key = _store_key(r, name, fields)
    until = time.time() + grace_s
    if info.expires_at is not None:
        until = min(until, info.expires_at)
    r.hset(api_key_key(info.digest), "expires_at", f"{until:.3f}")
    return key, replace(info, expires_at=round(until, 3))


def tenant_with_new_key(redis_url: str, name: str, **fields: object) -> str:
    """Create tenant `name` (or update its fields if it exists) and issue it a key; returns the key.

    For launchers and test stacks that need a ready tenant in one call."""
    from tenancy.redis_client import sync_client

    r = sync_client(redis_url)
    try:
        try:
            create_tenant(r, name, **fields)
        except TenantExists:
            update_tenant(r, name, **fields)
        return issue_key(r, name)
    finally:
        r.close()


def list_keys(r: redis.Redis, name: str | None = None) -> list[KeyInfo]:
    """Stored key records, of one tenant or of all."""
    if name is not None:
        digests = [d.decode() for d in r.smembers(tenant_keys_key(validate_name(name)))]
    else:
        digests = [k.decode()[len(API_KEY_PREFIX):]
                   for k in r.scan_iter(match=API_KEY_PREFIX + "*", count=500)]
    pipe = r.pipeline(transaction=False)
    for dig in digests:
        pipe.hmget(api_key_key(dig), "tenant", "prefix", "created_at", "models", "expires_at")
    infos = []
    for dig, (tenant, prefix, created, models, expires) in zip(digests, pipe.execute(), strict=True):
        if tenant is not None:
            infos.append(KeyInfo(dig, tenant.decode(), (prefix or b"").decode(), float(created or 0),
                                 parse_models((models or b"").decode()),
                                 parse_expiry(None if expires is None else expires.decode())))
    return sorted(infos, key=lambda k: (k.tenant, k.created_at))


def find_key(r: redis.Redis, key_prefix: str, tenant: str | None = None) -> KeyInfo:
    """The single key whose display prefix starts with `key_prefix` (or the whole key, or its SHA-256 digest),
    of `tenant` if given. Raises KeyNotFound when nothing matches and AmbiguousKeyPrefix when several keys
    do."""
    key_prefix = key_prefix.strip()
    if not key_prefix:
        raise TenancyError("empty key prefix")
    keys = list_keys(r, tenant)
    if _DIGEST.fullmatch(key_prefix):
        matches = [k for k in keys if k.digest == key_prefix]
    elif len(key_prefix) > apikeys.DISPLAY_PREFIX_CHARS:
        exact = apikeys.digest(key_prefix)  # a full key: match it exactly by digest
        matches = [k for k in keys if k.digest == exact]
    else:
        matches = [k for k in keys if k.prefix.startswith(key_prefix)]
    if not matches:
        hint = "" if len(key_prefix) <= apikeys.DISPLAY_PREFIX_CHARS else (
            f" (only the first {apikeys.DISPLAY_PREFIX_CHARS} characters are stored: give those, the "
            "whole key or its digest)")
        of = f" of tenant {tenant!r}" if tenant is not None else ""
        raise KeyNotFound(f"no API key{of} matches {key_prefix[:apikeys.DISPLAY_PREFIX_CHARS]!r}…{hint}")
    if len(matches) > 1:
        shown = ", ".join(f"{k.prefix}… ({k.tenant})" for k in matches[:10])
        raise AmbiguousKeyPrefix(f"{len(matches)} keys start with {key_prefix!r}: {shown}; "
                                 "give a longer prefix")
    return matches[0]


def revoke_key(r: redis.Redis, key_prefix: str) -> KeyInfo:
    """Revoke the single key `find_key` names (a display prefix, the whole key or its digest)."""
    info = find_key(r, key_prefix)
    pipe = r.pipeline(transaction=False)
    pipe.delete(api_key_key(info.digest))
    pipe.srem(tenant_keys_key(info.tenant), info.digest)
    pipe.execute()
    return info
