"""`switchyard money prices|budget|limits|assign|migrate|spend` (and the admin verbs): prices, budgets, rate
limits of the levels, spend."""

from __future__ import annotations

import argparse
import json

import redis

from admission.money.hierarchy import assign_project, migrate_projects, read_spend, set_budget, set_limits
from admission.money.keys import DEFAULT_ORG, PERIODS, micro_to_usd
from admission.money.prices import list_prices, set_price
from config import cmd_money_admin
from config.cmd_tenants import add_redis_argument, run_operator_command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("prices", help="set a model's prices (USD per million tokens) or list them")
    p.add_argument("model", nargs="?", help="model id, or '*' for models without their own (omit: list)")
    p.add_argument("--input", help="USD per million input tokens")
    p.add_argument("--cached", help="USD per million cached input tokens (default: the input price)")
    p.add_argument("--output", help="USD per million output tokens")
    p.add_argument("--batch", help="the fraction of these prices a Batch API request pays, 0-1 (default: "
                                   "1, no discount; OpenAI's is 0.5)")
    b = sub.add_parser("budget", help="set a level's dollar budget per calendar day or month, or rolling 24h "
                                      "or 30d (0 = unlimited)")
    b.add_argument("level", choices=("organization", "project", "key", "user"))
    b.add_argument("ident", help="organization or project name, or key digest; for `user`, the project")
    b.add_argument("--usd", required=True, help="budget in USD per period")
    b.add_argument("--period", choices=PERIODS, default="month")
    b.add_argument("--org", default=DEFAULT_ORG,
                   help=f"the project's or key's organization (default {DEFAULT_ORG!r})")
    b.add_argument("--model", help="the organization's or project's budget for this model alone")
    lim = sub.add_parser("limits",
                         help="set a level's tokens and requests per minute and concurrency (0 = none)")
    lim.add_argument("level", choices=("organization", "project", "key", "user"))
    lim.add_argument("ident", help="organization or project name, or key digest; for `user`, the project")
    lim.add_argument("--tpm", type=int, help="tokens (prompt + max_tokens) per minute")
    lim.add_argument("--rpm", type=int, help="requests per minute")
    lim.add_argument("--max-concurrent", type=int, help="requests in flight")
    lim.add_argument("--org", default=DEFAULT_ORG, help="the project's or key's organization")
    lim.add_argument("--model", help="the organization's or project's limits for this model alone (a "
                     "project's own limits are its tenant record's: switchyard tenants)")
    a = sub.add_parser("assign", help="put a project (tenant) into an organization")
    a.add_argument("project")
    a.add_argument("org")
    sub.add_parser("migrate", help="make every tenant without an organization a project of the default one")
    s = sub.add_parser("spend", help="an organization's recorded spend per UTC day")
    s.add_argument("--org", default=DEFAULT_ORG)
    s.add_argument("--days", type=int, default=7)
    s.add_argument("--by", default="org",
                   help="dimension: org, project, key, model, user or p (all combined); default org")
    for sp in (p, b, lim, a, s, sub.choices["migrate"], *cmd_money_admin.add_arguments(sub)):
        add_redis_argument(sp)
        sp.add_argument("--json", action="store_true", help="print JSON on one line")


def _prices(r: redis.Redis, args: argparse.Namespace) -> object:
    if args.model is None:
        return list_prices(r)
    if args.input is None or args.output is None:
        raise ValueError("setting a price needs --input and --output")
    set_price(r, args.model, args.input, args.cached, args.output, args.batch)
    return {args.model: list_prices(r)[args.model]}


def _budget(r: redis.Redis, args: argparse.Namespace) -> object:
    level, user_default = ("project", True) if args.level == "user" else (args.level, False)
    org = args.ident if level == "organization" else args.org
    ident = args.ident
    s = set_budget(r, org, level, ident, args.usd, args.period, user_default=user_default, model=args.model)
    return {"org": org, "level": args.level, "ident": ident, "model": args.model,
            "budget_usd": micro_to_usd(s.budget_micro), "period": s.period}


def _limits(r: redis.Redis, args: argparse.Namespace) -> object:
    level, user_default = ("project", True) if args.level == "user" else (args.level, False)
    org = args.ident if level == "organization" else args.org
    limits = set_limits(r, org, level, args.ident, tpm=args.tpm, rpm=args.rpm,
                        max_concurrent=args.max_concurrent, user_default=user_default, model=args.model)
    return {"org": org, "level": args.level, "ident": args.ident, "model": args.model, **limits}


def _spend(r: redis.Redis, args: argparse.Namespace) -> object:
    out = {}
    for day, fields in read_spend(r, args.org, args.days).items():
        rows: dict[str, dict[str, object]] = {}
        for name, value in fields.items():
            dim, _, counter = name.rpartition("|")
            if dim.split(":", 1)[0] != args.by:
                continue
            row = rows.setdefault(dim, {})
            if counter == "cost_micro":
                row["cost_usd"] = micro_to_usd(value)
            else:
                row[counter] = value
        out[day] = rows
    return out


def run(args: argparse.Namespace) -> int:
    if args.verb in cmd_money_admin.VERBS:
        return cmd_money_admin.run(args)

    def action(r: redis.Redis) -> int:
        if args.verb == "prices":
            result = _prices(r, args)
        elif args.verb == "budget":
            result = _budget(r, args)
        elif args.verb == "limits":
            result = _limits(r, args)
        elif args.verb == "assign":
            assign_project(r, args.project, args.org)
            result = {"project": args.project, "org": args.org}
        elif args.verb == "migrate":
            result = {"moved": migrate_projects(r)}
        else:
            result = _spend(r, args)
        print(json.dumps(result, indent=None if args.json else 2))
        return 0

    return run_operator_command(args, action)
