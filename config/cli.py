"""The `switchyard` command: a thin dispatcher over one module per subcommand.

Subcommand modules load lazily, so `switchyard tenants list` does not pay for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "worker": ("config.cmd_worker", "run a worker process (engine + ZeroMQ server)"),
    "gateway": ("config.cmd_gateway", "run the OpenAI-compatible HTTP gateway"),
    "tenants": ("config.cmd_tenants", "create, update, list and disable tenants"),
    "keys": ("config.cmd_keys", "issue and revoke tenant API keys"),
    "usage": ("config.cmd_usage", "print a tenant's metered usage"),
    "money": ("config.cmd_money", "prices, dollar budgets per organization/project/key/user, and spend"),
    "redis": ("config.cmd_redis", "Redis maintenance: migrate-keys (hash-tagged names for Redis Cluster)"),
    "bench": ("config.cmd_bench", "load-test an OpenAI-compatible server"),
}


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, object | None]:
    parser = argparse.ArgumentParser(prog="switchyard", description="Switchyard LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = argv[0] if argv else None
    module = None
    for name, (mod_name, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text)
        if name == chosen:
            module = importlib.import_module(mod_name)
            module.add_arguments(sp)
    return parser, module


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, module = build_parser(argv)
    args = parser.parse_args(argv)
    if module is None:
        parser.error(f"unknown command {args.command!r}")
    return int(module.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
