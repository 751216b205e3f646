"""Operator-side tenant and API key management over a blocking Redis client (CLI, tests, `make run`).

Writes the same config hash an operator's `redis-cli HSET` would; plaintext keys are returned once, never
stored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

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
    parse_tenant,
    tenant_keys_key,
    validate_name,
)
from tenancy.tenancy_errors import AmbiguousKeyPrefix, KeyNotFound, TenancyError, TenantExists, TenantNotFound

SETTABLE_FIELDS = (*INT_DEFAULTS, "priority", "allowed_models", "status", "weight")


@dataclass(slots=True, frozen=True)
class KeyInfo:
    """What is stored about one API key (never the key itself)."""

    digest: str
    tenant: str
    prefix: str
    created_at: float


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


def _models_value(value: object) -> str:
    items = value if isinstance(value, list | tuple) else str(value).split(",")
    models = [str(m).strip() for m in items if str(m).strip()]
    if not models:
        raise TenancyError("allowed_models must be '*' or a comma-separated list of model ids")
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


def issue_key(r: redis.Redis, name: str) -> str:
    """Make a new API key for tenant `name`; the returned plaintext is the only copy."""
    get_tenant(r, name)
    key = apikeys.new_api_key()
    dig = apikeys.digest(key)
    pipe = r.pipeline(transaction=False)
    pipe.hset(api_key_key(dig), mapping={
        "tenant": name, "prefix": apikeys.display_prefix(key), "created_at": f"{time.time():.3f}"})
    pipe.sadd(tenant_keys_key(name), dig)
    pipe.execute()
    return key


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
        pipe.hmget(api_key_key(dig), "tenant", "prefix", "created_at")
    infos = []
    for dig, (tenant, prefix, created) in zip(digests, pipe.execute(), strict=True):
        if tenant is not None:
            infos.append(KeyInfo(dig, tenant.decode(), (prefix or b"").decode(), float(created or 0)))
    return sorted(infos, key=lambda k: (k.tenant, k.created_at))


def revoke_key(r: redis.Redis, key_prefix: str) -> KeyInfo:
    """Revoke the single key whose display prefix starts with `key_prefix` (or the full key itself).

    Raises KeyNotFound when nothing matches and AmbiguousKeyPrefix when several keys do.
    """
    key_prefix = key_prefix.strip()
    if not key_prefix:
        raise TenancyError("empty key prefix")
    if len(key_prefix) > apikeys.DISPLAY_PREFIX_CHARS:
        exact = apikeys.digest(key_prefix)  # a full key: match it exactly by digest
        matches = [k for k in list_keys(r) if k.digest == exact]
    else:
        matches = [k for k in list_keys(r) if k.prefix.startswith(key_prefix)]
    if not matches:
        hint = "" if len(key_prefix) <= apikeys.DISPLAY_PREFIX_CHARS else (
            f" (only the first {apikeys.DISPLAY_PREFIX_CHARS} characters are stored: give those, or the "
            "whole key)")
        raise KeyNotFound(f"no API key matches {key_prefix[:apikeys.DISPLAY_PREFIX_CHARS]!r}…{hint}")
    if len(matches) > 1:
        shown = ", ".join(f"{k.prefix}… ({k.tenant})" for k in matches[:10])
        raise AmbiguousKeyPrefix(f"{len(matches)} keys start with {key_prefix!r}: {shown}; "
                                 "give a longer prefix")
    info = matches[0]
    pipe = r.pipeline(transaction=False)
    pipe.delete(api_key_key(info.digest))
    pipe.srem(tenant_keys_key(info.tenant), info.digest)
    pipe.execute()
    return info
