"""`switchyard usage NAME [--days N] [--json]`: a tenant's metered usage per UTC day."""

from __future__ import annotations

import argparse
import json

import redis

from admission import read_usage
from config.cmd_tenants import add_redis_argument, run_operator_command
from tenancy import get_tenant


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name")
    parser.add_argument("--days", type=int, default=7, help="how many days back, today included (default 7)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_redis_argument(parser)


def run(args: argparse.Namespace) -> int:
    def action(r: redis.Redis) -> int:
        get_tenant(r, args.name)  # unknown tenant -> clear error
        days = read_usage(r, args.name, args.days)
        if args.json:
            print(json.dumps([{"day": d.day, "requests": d.requests, "prompt_tokens": d.prompt_tokens,
                               "cached_tokens": d.cached_tokens, "completion_tokens": d.completion_tokens}
                              for d in days]))
            return 0
        print(f"{'DAY':<10}  {'REQUESTS':>9}  {'PROMPT':>11}  {'CACHED':>11}  {'COMPLETION':>11}")
        for d in days:
            print(f"{d.day:<10}  {d.requests:>9}  {d.prompt_tokens:>11}  {d.cached_tokens:>11}  "
                  f"{d.completion_tokens:>11}")
        totals = [sum(getattr(d, f) for d in days)
                  for f in ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")]
        print(f"{'total':<10}  {totals[0]:>9}  {totals[1]:>11}  {totals[2]:>11}  {totals[3]:>11}")
        return 0

    return run_operator_command(args, action)
