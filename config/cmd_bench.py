"""`switchyard bench`: load-test any OpenAI-compatible server and write a report (`config.loadtest.loadgen`,
`config.loadtest.report`). A measurement tool with no targets of its own: exits 0 when the run completes."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

from config.loadtest.loadgen import WORKLOADS, LoadConfig, build_workload, run_load


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--key", default=os.environ.get("SWITCHYARD_BENCH_KEY", ""),
                        help="API key sent as a Bearer token (default: $SWITCHYARD_BENCH_KEY)")
    parser.add_argument("--workload", choices=WORKLOADS, default="mixed")
    parser.add_argument("--n", type=int, default=100, help="number of requests")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--model", default=None, help="model name (default: first of GET /v1/models)")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="completion budget per request (mixed: the upper bound)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--prompt-words", type=int, default=None,
                        help="prompt size in words: single's prompt, prefix's system prompts, mixed's upper "
                             "bound (defaults 6, 300, 400)")
    parser.add_argument("--timeout", type=float, default=120.0, help="per-request deadline in seconds")
    parser.add_argument("--compare", type=Path, default=None, metavar="DIR2",
                        help="an earlier bench output directory to overlay on the plots and table")
    parser.add_argument("--label", default=None,
                        help="name of this run in plots (default: the --out folder name)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _check(args: argparse.Namespace) -> str | None:
    if args.n < 1:
        return "--n must be at least 1"
    if args.concurrency < 1:
        return "--concurrency must be at least 1"
    if args.max_tokens < 1:
        return "--max-tokens must be at least 1"
    if args.prompt_words is not None and args.prompt_words < 4:
        return "--prompt-words must be at least 4"
    if args.timeout <= 0:
        return "--timeout must be positive"
    if not args.key:
        return "--key is required (or set SWITCHYARD_BENCH_KEY)"
    if args.compare is not None and not (args.compare / "result.json").is_file():
        return f"--compare {args.compare}: no result.json there"
    if not args.url.startswith(("http://", "https://")):
        return "--url must start with http:// or https://"
    return None


def run(args: argparse.Namespace) -> int:
    from config.loadtest.report import save_run, summarize, write_report

    problem = _check(args)
    if problem is not None:
        print(f"switchyard bench: {problem}", file=sys.stderr)
        return 2
    specs = build_workload(args.workload, args.n, seed=args.seed, max_tokens=args.max_tokens,
                           prompt_words=args.prompt_words)
    config = LoadConfig(url=args.url, key=args.key, model=args.model, concurrency=args.concurrency,
                        request_timeout=args.timeout, progress=not args.no_progress)
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    try:
        records, duration, model = asyncio.run(run_load(config, specs))
    except Exception as exc:  # the server was unusable before any request ran (e.g. /v1/models failed)
        print(f"switchyard bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    meta = {
        "label": args.label or args.out.resolve().name, "workload": args.workload, "model": model,
        "url": args.url, "concurrency": args.concurrency, "max_tokens": args.max_tokens, "seed": args.seed,
        "prompt_words": args.prompt_words,
        "timeout_s": args.timeout, "started_at": started_at,
    }
    summary = summarize(records, duration, meta)
    save_run(args.out, summary, records)
    try:
        write_report(args.out, args.compare)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # e.g. a --compare run with broken samples
        print(f"switchyard bench: results saved in {args.out}, but the report failed: {exc}", file=sys.stderr)
        return 1
    print(args.out / "result.json")
    print(f"completed {summary['completed']}/{summary['n']} in {summary['duration_s']:.2f}s: "
          f"{summary['requests_per_s']:.2f} req/s, {summary['output_tokens_per_s']:.1f} output tok/s, "
          f"TTFT p50 {summary['ttft_ms']['p50']} ms, errors {summary['errors'] or 'none'}")
    for key, message in summary["error_examples"].items():
        print(f"switchyard bench: error {key}: {message}", file=sys.stderr)
    return 0 if summary["completed"] > 0 else 1
