"""`switchyard redis migrate-keys`: move the untagged keys of older releases to their Redis Cluster names."""

from __future__ import annotations

import argparse

import redis

from admission.money.hierarchy import migrate_projects
from config.cmd_tenants import add_redis_argument, run_operator_command
from tenancy.migrate import migrate_keys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("migrate-keys",
                       help="rename untagged keys (worker registry, gateway records) to their "
                            "hash-tagged names; safe to run again")
    p.add_argument("--dry-run", action="store_true", help="list what would move; change nothing")
    add_redis_argument(p)


def run(args: argparse.Namespace) -> int:
    def action(r: redis.Redis) -> int:
        report = migrate_keys(r, dry_run=args.dry_run)
        verb = "would move" if args.dry_run else "moved"
        for kind, pairs in (("", report.moved), (" (merged)", report.merged),
                            (" (newer key kept)", report.superseded)):
            for old, new in pairs:
                print(f"{verb} {old} -> {new}{kind}")
        print(f"{report.total} key(s) {verb}" + ("" if report.total else ": nothing to migrate"))
        if not args.dry_run:  # today's tenants become projects of the default organization (once)
            for name in migrate_projects(r):
                print(f"tenant {name} -> a project of organization default")
        return 0

    return run_operator_command(args, action)
