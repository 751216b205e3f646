"""`switchyard keys issue|revoke|list`: tenant API keys.

A new key is printed once and alone on stdout (only its digest is stored), so scripts can capture it.
"""

from __future__ import annotations

import argparse
import time

import redis

from config.cmd_tenants import add_redis_argument, run_operator_command
from tenancy import issue_key, list_keys, revoke_key


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("issue", help="issue a new key for a tenant (printed once, alone)")
    p.add_argument("name")
    add_redis_argument(p)
    p = sub.add_parser("revoke", help="revoke the key with this prefix (first ~10 chars) or the whole key")
    p.add_argument("key_prefix")
    add_redis_argument(p)
    p = sub.add_parser("list", help="list key prefixes, of one tenant or all")
    p.add_argument("name", nargs="?")
    add_redis_argument(p)


def run(args: argparse.Namespace) -> int:
    def action(r: redis.Redis) -> int:
        if args.action == "issue":
            print(issue_key(r, args.name))
        elif args.action == "revoke":
            info = revoke_key(r, args.key_prefix)
            print(f"revoked {info.prefix}… of tenant {info.tenant}")
        else:
            for k in list_keys(r, args.name):
                created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(k.created_at))
                print(f"{k.prefix}…  {k.tenant}  {created}")
        return 0

    return run_operator_command(args, action)
