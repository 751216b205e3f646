"""`switchyard tenants create|set|list|disable|enable`: manage tenants in Redis.

Also home of the `--redis-url` option and operator error handling shared with `keys` and `usage`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import redis
from redis.exceptions import RedisClusterException

from tenancy import (
    PRIORITIES,
    TenancyError,
    Tenant,
    create_tenant,
    list_tenants,
    set_status,
    update_tenant,
)

QUOTA_OPTIONS = ("tpm", "rpm", "max_concurrent", "max_tokens", "default_max_tokens", "ttft_slo_ms")


def add_redis_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", default=None, help="Redis URL (default: $SWITCHYARD_REDIS_URL)")


def redis_from_args(args: argparse.Namespace) -> redis.Redis:
    from tenancy import sync_client

    url = args.redis_url or os.environ.get("SWITCHYARD_REDIS_URL")
    if not url:
        raise TenancyError("no Redis URL: pass --redis-url or set SWITCHYARD_REDIS_URL")
    return sync_client(url)


def run_operator_command(args: argparse.Namespace, action: Callable[[redis.Redis], int]) -> int:
    """Run `action` with a Redis client; operator-facing errors become one stderr line and exit 1."""
    try:
        client = redis_from_args(args)
    except TenancyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return action(client)
    except (TenancyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (redis.RedisError, RedisClusterException) as exc:
        print(f"error: Redis unreachable or failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()


def _add_quota_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tpm", type=int, help="tokens per minute (0 = unlimited)")
    p.add_argument("--rpm", type=int, help="requests per minute (0 = unlimited)")
    p.add_argument("--max-concurrent", type=int, help="concurrent requests (0 = unlimited)")
    p.add_argument("--max-tokens", type=int, help="cap on max_tokens per request")
    p.add_argument("--default-max-tokens", type=int, help="max_tokens when a request gives none")
    p.add_argument("--ttft-slo-ms", type=int,
                   help="time-to-first-token target in ms (0 = the priority class's default)")
    p.add_argument("--priority", choices=PRIORITIES, help="priority class")
    p.add_argument("--weight", type=float, help="relative fair share on a worker (default 1)")
    p.add_argument("--models", help="allowed model ids, comma-separated, or '*'")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    for name, help_text in (("create", "create a tenant"), ("set", "change a tenant's fields")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("name")
        _add_quota_options(p)
        add_redis_argument(p)
    p = sub.add_parser("list", help="list tenants")
    add_redis_argument(p)
    for name in ("disable", "enable"):
        p = sub.add_parser(name, help=f"{name} a tenant (its keys stop/start working within 1 s)")
        p.add_argument("name")
        add_redis_argument(p)


def _fields(args: argparse.Namespace) -> dict[str, object]:
    fields: dict[str, object] = {k: getattr(args, k) for k in QUOTA_OPTIONS}
    fields["priority"] = args.priority
    fields["weight"] = args.weight
    fields["allowed_models"] = args.models
    return fields


def describe(t: Tenant) -> str:
    models = ",".join(t.allowed_models) if t.allowed_models is not None else "*"
    return (f"{t.name} status={t.status} priority={t.priority.label} tpm={t.tpm} rpm={t.rpm} "
            f"max_concurrent={t.max_concurrent} max_tokens={t.max_tokens} "
            f"default_max_tokens={t.default_max_tokens} ttft_slo_ms={t.ttft_slo_ms} weight={t.weight:g} "
            f"models={models}")


def _list(r: redis.Redis) -> int:
    header = ("NAME", "STATUS", "PRIORITY", "TPM", "RPM", "MAX_CONC", "MAX_TOKENS", "DEF_MAX", "WEIGHT",
              "KEYS", "MODELS")
    rows = [header]
    for t, nkeys in list_tenants(r):
        models = ",".join(t.allowed_models) if t.allowed_models is not None else "*"
        rows.append((t.name, t.status, t.priority.label, str(t.tpm), str(t.rpm), str(t.max_concurrent),
                     str(t.max_tokens), str(t.default_max_tokens), f"{t.weight:g}", str(nkeys), models))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def run(args: argparse.Namespace) -> int:
    def action(r: redis.Redis) -> int:
        if args.action == "create":
            print(f"created {describe(create_tenant(r, args.name, **_fields(args)))}")
        elif args.action == "set":
            print(f"updated {describe(update_tenant(r, args.name, **_fields(args)))}")
        elif args.action == "list":
            return _list(r)
        else:
            t = set_status(r, args.name, active=args.action == "enable")
            print(f"{args.action}d {t.name}")
        return 0

    return run_operator_command(args, action)
