"""`switchyard keys issue|create|rotate|revoke|list`: tenant API keys, their model scope and expiry.

A new key is printed once and alone on stdout (only its digest is stored), so scripts can capture it.
"""

from __future__ import annotations

import argparse
import re
import sys
import time

import redis

from admission.money.hierarchy import copy_key_budget
from config.cmd_tenants import add_redis_argument, run_operator_command
from tenancy import KeyInfo, issue_key, key_digest, list_keys, revoke_key, rotate_key

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86_400}


def duration_s(text: str) -> float:
    """`30d`, `12h`, `90m`, `3600s` or `3600` as seconds; ValueError otherwise."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"duration {text!r}: use a number with an optional unit s, m, h or d (e.g. 30d)")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("issue", aliases=["create"], help="issue a new key for a tenant (printed once, alone)")
    p.add_argument("name")
    _add_key_options(p)
    p = sub.add_parser("rotate", help="issue a key with an old key's scope and limits; the old one expires "
                                      "after --grace")
    p.add_argument("name")
    p.add_argument("old_key", help="the old key's display prefix, the whole key or its digest")
    p.add_argument("--grace", default="1h", help="how long the old key keeps working (default 1h)")
    p.add_argument("--expires-in", default=None, help="the new key's lifetime (default: never expires)")
    add_redis_argument(p)
    p = sub.add_parser("revoke", help="revoke the key with this prefix (~10 chars), whole key or digest")
    p.add_argument("key_prefix")
    add_redis_argument(p)
    p = sub.add_parser("list", help="list keys with their model scope and expiry, of one tenant or all")
    p.add_argument("name", nargs="?")
    add_redis_argument(p)


def _add_key_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=None,
                   help="comma list of models or aliases the key may use, within its tenant's (default: all)")
    p.add_argument("--expires-in", default=None, help="lifetime such as 30d, 12h, 3600 (default: never)")
    add_redis_argument(p)


def _expires_at(expires_in: str | None) -> float | None:
    return None if expires_in is None else time.time() + duration_s(expires_in)


def _rotate(r: redis.Redis, args: argparse.Namespace) -> None:
    key, old = rotate_key(r, args.name, args.old_key, duration_s(args.grace), _expires_at(args.expires_in))
    copied = copy_key_budget(r, args.name, old.digest, key_digest(key))
    print(key)
    note = "; its dollar budget is copied to the new key" if copied else ""
    print(f"rotated {old.prefix}… of tenant {args.name}: it expires at {_when(old.expires_at)}{note}",
          file=sys.stderr)


def _when(ts: float | None) -> str:
    return "never" if ts is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _row(k: KeyInfo, now: float) -> str:
    models = ",".join(k.models) if k.models is not None else "*"
    expiry = _when(k.expires_at) + (" (expired)" if k.expired(now) else "")
    return f"{k.prefix}…  {k.tenant}  {_when(k.created_at)}  models={models}  expires={expiry}"


def run(args: argparse.Namespace) -> int:
    def action(r: redis.Redis) -> int:
        if args.action in ("issue", "create"):
            print(issue_key(r, args.name, models=args.models, expires_at=_expires_at(args.expires_in)))
        elif args.action == "rotate":
            _rotate(r, args)
        elif args.action == "revoke":
            info = revoke_key(r, args.key_prefix)
            print(f"revoked {info.prefix}… of tenant {info.tenant}")
        else:
            now = time.time()
            for k in list_keys(r, args.name):
                print(_row(k, now))
        return 0

    return run_operator_command(args, action)
