"""`switchyard money admin-key|projects|api-keys|usage|costs`: the administration API's verbs and answers."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

import redis
import redis.asyncio as aredis
from redis.exceptions import RedisClusterException

from admission.money.admin_keys import create_admin_key, list_admin_keys, revoke_admin_key
from config.cmd_tenants import run_operator_command
from gateway.admin import project_admin, project_keys
from gateway.admin.admin_query import DAY_S, list_object, parse_usage_query
from gateway.admin.admin_scope import AdminScope, scope_orgs
from gateway.admin.usage_buckets import build_page, read_ledger
from gateway.web.api_errors import ApiError

VERBS = ("admin-key", "projects", "api-keys", "usage", "costs")
_FILTER_OPTIONS = {"completions": (("project_ids", "--project-id"), ("api_key_ids", "--api-key-id"),
                                   ("models", "--model"), ("user_ids", "--user-id")),
                   "costs": (("project_ids", "--project-id"), ("api_key_ids", "--api-key-id"),
                             ("line_items", "--line-item"))}


def add_arguments(sub: Any) -> list[argparse.ArgumentParser]:
    """The verbs' parsers (the caller adds `--redis-url` and `--json` to each)."""
    k = sub.add_parser("admin-key", help="create (shown once), list or revoke admin keys")
    k.add_argument("action", choices=("create", "list", "revoke"))
    k.add_argument("ident", nargs="?", help="revoke: the key's digest (or its start)")
    k.add_argument("--org", help="create: the organization the key sees (default: --global)")
    k.add_argument("--global", dest="is_global", action="store_true", help="create: a key of every org")
    k.add_argument("--name", default="")
    p = sub.add_parser("projects", help="list, create or archive projects (tenants) of an organization")
    p.add_argument("action", choices=("list", "create", "archive"))
    p.add_argument("name", nargs="?")
    p.add_argument("--include-archived", action="store_true")
    a = sub.add_parser("api-keys", help="list a project's API keys or revoke one (by its id, the digest)")
    a.add_argument("action", choices=("list", "revoke"))
    a.add_argument("project")
    a.add_argument("key_id", nargs="?")
    out = [k, p, a]
    for kind, verb in (("completions", "usage"), ("costs", "costs")):
        u = sub.add_parser(verb, help=f"{verb} per UTC day, as GET /v1/organization/"
                                      f"{'usage/completions' if verb == 'usage' else 'costs'} answers")
        u.add_argument("--start-time", type=int, help="epoch seconds (default: 6 days before today)")
        u.add_argument("--end-time", type=int)
        u.add_argument("--bucket-width")
        u.add_argument("--group-by", action="append", default=[])
        for param, flag in _FILTER_OPTIONS[kind]:
            u.add_argument(flag, dest=param, action="append", default=[])
        u.add_argument("--limit", type=int)
        u.add_argument("--page")
        out.append(u)
    for parser in out[1:]:
        parser.add_argument("--org", help="only this organization (default: every one)")
    return out


def _admin_key(r: redis.Redis, args: argparse.Namespace) -> object:
    if args.action == "create":
        if bool(args.org) == args.is_global:
            raise ValueError("admin-key create needs one of --org ORG or --global")
        key, info = create_admin_key(r, args.org, args.name)
        return {"key": key, "digest": info.digest, "org": info.org or "*",
                "note": "shown once: Redis keeps only its digest"}
    if args.action == "list":
        return [{"digest": k.digest, "org": k.org or "*", "prefix": k.prefix, "name": k.name,
                 "created_at": k.created_at} for k in list_admin_keys(r)]
    if not args.ident:
        raise ValueError("admin-key revoke needs the key's digest")
    info = revoke_admin_key(r, args.ident)
    return {"revoked": info.digest, "org": info.org or "*"}


def usage_pairs(args: argparse.Namespace, kind: str, now: float) -> list[tuple[str, str]]:
    """The options as the query parameters of the HTTP route (the same parser checks both)."""
    start = args.start_time
    if start is None:
        start = int(now) - int(now) % DAY_S - 6 * DAY_S
    pairs = [("start_time", str(start))]
    for name in ("end_time", "bucket_width", "limit", "page"):
        if getattr(args, name) is not None:
            pairs.append((name, str(getattr(args, name))))
    pairs += [("group_by[]", g) for g in args.group_by]
    for param, _ in _FILTER_OPTIONS[kind]:
        pairs += [(param + "[]", v) for v in getattr(args, param)]
    return pairs


async def _admin(client: aredis.Redis, args: argparse.Namespace) -> object:
    scope = AdminScope(args.org)
    if args.verb in ("usage", "costs"):
        kind = "completions" if args.verb == "usage" else "costs"
        query = parse_usage_query(usage_pairs(args, kind, time.time()), kind)
        return build_page(query, await read_ledger(client, await scope_orgs(client, scope), query))
    if args.verb == "projects":
        if args.action == "list":
            found = await project_admin.list_projects(client, scope, args.include_archived)
            return list_object(found, {"limit": "100"})
        if not args.name:
            raise ValueError(f"projects {args.action} needs a project name")
        if args.action == "create":
            return await project_admin.create_project(client, scope, args.name)
        return await project_admin.archive_project(client, scope, args.name)
    if args.action == "list":
        return list_object(await project_keys.list_keys(client, scope, args.project), {"limit": "100"})
    if not args.key_id:
        raise ValueError("api-keys revoke needs the key's id (its digest)")
    return await project_keys.delete_key(client, scope, args.project, args.key_id)


async def _run_async(url: str, args: argparse.Namespace) -> object:
    from tenancy import async_client

    client = async_client(url)
    try:
        return await _admin(client, args)
    finally:
        await client.aclose()


def run(args: argparse.Namespace) -> int:
    """One admin verb; its JSON on stdout, an error as one stderr line (exit 1)."""
    if args.verb == "admin-key":
        return run_operator_command(args, lambda r: _print(args, _admin_key(r, args)))
    url = args.redis_url or os.environ.get("SWITCHYARD_REDIS_URL")
    if not url:
        print("error: no Redis URL: pass --redis-url or set SWITCHYARD_REDIS_URL", file=sys.stderr)
        return 2
    try:
        return _print(args, asyncio.run(_run_async(url, args)))
    except ApiError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
    except (redis.RedisError, RedisClusterException) as exc:
        print(f"error: Redis unreachable or failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 1


def _print(args: argparse.Namespace, result: object) -> int:
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
