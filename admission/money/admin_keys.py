"""Admin keys of the administration API: one organization's or global, stored only as SHA-256 digests."""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass

import redis

from admission.money.keys import ORGS_SET, validate_org
from tenancy.apikeys import digest

ADMIN_KEY_PREFIX = "sy-admin-"
ADMIN_KEY_RANDOM_CHARS = 40
ADMIN_KEYS_SET = "sy:admin_keys"      # set of the digests of every admin key (for listing)
ADMIN_KEY_RECORD = "sy:admin_key:"     # sy:admin_key:<sha256 hex> -> hash {org, prefix, name, created_at}
GLOBAL = "*"                           # the `org` of an operator's key: every organization
DISPLAY_CHARS = 14                     # "sy-admin-" and five random characters
_SHAPE = re.compile(re.escape(ADMIN_KEY_PREFIX) + f"[A-Za-z0-9_-]{{{ADMIN_KEY_RANDOM_CHARS}}}")


@dataclass(slots=True, frozen=True)
class AdminKey:
    """What is stored about one admin key (never the key itself); `org` None: global."""

    digest: str
    org: str | None
    prefix: str
    name: str
    created_at: int

    def sees(self, org: str) -> bool:
        return self.org is None or self.org == org


def admin_key_key(key_digest: str) -> str:
    return ADMIN_KEY_RECORD + key_digest


def admin_key_shape_ok(key: str) -> bool:
    """`key` has the shape of an issued admin key (tenant API keys do not)."""
    return _SHAPE.fullmatch(key) is not None


def _text(v: str | bytes | None) -> str:
    return v.decode() if isinstance(v, bytes) else (v or "")


def parse_admin_key(key_digest: str, fields: dict) -> AdminKey | None:
    """The record of `HGETALL sy:admin_key:<digest>` (None when absent or without an `org`)."""
    f = {_text(k): _text(v) for k, v in fields.items()}
    org = f.get("org", "")
    if not org:
        return None
    try:
        created = int(float(f.get("created_at") or 0))
    except ValueError:
        created = 0
    return AdminKey(key_digest, None if org == GLOBAL else org, f.get("prefix", ""), f.get("name", ""),
                    created)


def create_admin_key(r: redis.Redis, org: str | None, name: str = "") -> tuple[str, AdminKey]:
    """A new admin key of `org` (None: global); the returned plaintext is the only copy."""
    if org is not None:
        validate_org(org)
        r.sadd(ORGS_SET, org)
    key = ADMIN_KEY_PREFIX + secrets.token_urlsafe(30)[:ADMIN_KEY_RANDOM_CHARS]
    dig = digest(key)
    record = {"org": org or GLOBAL, "prefix": key[:DISPLAY_CHARS], "name": name[:200],
              "created_at": str(int(time.time()))}
    pipe = r.pipeline(transaction=False)
    pipe.hset(admin_key_key(dig), mapping=record)
    pipe.sadd(ADMIN_KEYS_SET, dig)
    pipe.execute()
    info = parse_admin_key(dig, record)
    assert info is not None
    return key, info


def list_admin_keys(r: redis.Redis) -> list[AdminKey]:
    """Every stored admin key, oldest first."""
    digests = sorted(_text(d) for d in r.smembers(ADMIN_KEYS_SET))
    out = [parse_admin_key(d, r.hgetall(admin_key_key(d))) for d in digests]
    return sorted((k for k in out if k is not None), key=lambda k: (k.created_at, k.digest))


def revoke_admin_key(r: redis.Redis, ident: str) -> AdminKey:
    """Revoke the one admin key whose digest or display prefix starts with `ident` (or the key itself)."""
    ident = ident.strip()
    if not ident:
        raise ValueError("empty admin key prefix")
    if admin_key_shape_ok(ident):
        matches = [k for k in list_admin_keys(r) if k.digest == digest(ident)]
    else:
        matches = [k for k in list_admin_keys(r) if k.digest.startswith(ident) or
                   (len(ident) > len(ADMIN_KEY_PREFIX) and k.prefix.startswith(ident))]
    if len(matches) != 1:
        raise ValueError(f"{len(matches)} admin keys match {ident[:DISPLAY_CHARS]!r}: give its digest")
    info = matches[0]
    pipe = r.pipeline(transaction=False)
    pipe.delete(admin_key_key(info.digest))
    pipe.srem(ADMIN_KEYS_SET, info.digest)
    pipe.execute()
    return info
