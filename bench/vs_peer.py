"""Benchmark: Switchyard against a peer server (vLLM) with the peers' own load generator, side by side.

Two passes of ours, peer, ours, peer, never both up at once; the three workloads of
`../shared/peers/loadgen.py` per pass plus `long` (2-3k-token prompts, 256 out, concurrency 8:
`bench/long_loadgen.py`); one JSON line with both sides' raw figures and median ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from bench.machine import cpu_model

REPO = Path(__file__).resolve().parent.parent

PEERS = Path(os.environ.get("PEERS", Path.home() / ".cache" / "peers"))
# ../shared/peers/loadgen.py next to the checkout (or next to its worktrees' folder)
LOADGEN = next((p for p in (REPO.parent / "shared" / "peers" / "loadgen.py",
                            REPO.parent.parent / "shared" / "peers" / "loadgen.py") if p.exists()),
               REPO.parent / "shared" / "peers" / "loadgen.py")
# workload -> (n, concurrency): the README's figures, and the --quick ones
FULL = {"mixed": (64, 16), "prefix": (32, 8), "single": (8, 1), "long": (16, 8),
        "nmixed": (64, 16), "nprefix": (32, 8), "nsingle": (8, 1)}
QUICK = {"mixed": (8, 4), "prefix": (4, 2), "single": (2, 1), "long": (2, 2),
         "nmixed": (8, 4), "nprefix": (4, 2), "nsingle": (2, 1)}
# ratio name -> (workload, loadgen field); all ours / peer
RATIOS = {"mixed_out_tok_s": ("mixed", "out_tok_s"), "prefix_ttft_p50": ("prefix", "ttft_p50_ms"),
          "single_tpot_p50": ("single", "tpot_p50_ms"), "single_ttft_p50": ("single", "ttft_p50_ms"),
          "long_out_tok_s": ("long", "out_tok_s"),
          "natural_mixed_out_tok_s": ("nmixed", "out_tok_s"),
          "natural_prefix_ttft_p50": ("nprefix", "ttft_p50_ms"),
          "natural_single_tpot_p50": ("nsingle", "tpot_p50_ms"),
          "natural_single_ttft_p50": ("nsingle", "ttft_p50_ms")}
# the shared generator plus `long` and the natural-text workloads (nmixed, nprefix, nsingle)
LONG_LOADGEN = Path(__file__).with_name("long_loadgen.py")
UNLIMITED = {"tpm": 0, "rpm": 0, "max_concurrent": 0, "max_tokens": 4096}

Side = Callable[[], "Server"]


class Server:
    """A running system under test: where to send load, and how to stop it."""

    def __init__(self, url: str, key: str, model: str, stop: Callable[[], None]) -> None:
        self.url, self.key, self.model, self._stop = url, key, model, stop

    def stop(self) -> None:
        self._stop()


# ---------------------------------------------------------------- the two sides

def start_ours(args: argparse.Namespace, log_dir: Path) -> Server:
    """One worker and one gateway through the project's launcher, with a demo tenant with no limits."""
    from config.local_stack.launcher import DEMO_TENANT, Stack, StackConfig, free_port

    wargs = ["--quantization", args.quantization, "--num-threads", str(args.threads),
             *shlex.split(args.worker_args)]
    if args.dtype != "auto":
        wargs += ["--dtype", args.dtype]
    stack = Stack(StackConfig(port=free_port(), model=args.model, worker_args=wargs,
                              ready_timeout=args.ready_timeout, log_dir=log_dir))
    stack.start()
    try:
        key = stack.create_tenant(DEMO_TENANT, **UNLIMITED)
    except BaseException:
        stack.stop()
        raise
    return Server(stack.base_url, key, args.model, stack.stop)


def start_peer(args: argparse.Namespace) -> Server:
    """The peer at --peer-url, started by --peer-start (which prints a PID) when given, ready on
    /v1/models."""
    pid = None
    if args.peer_start:
        out = subprocess.run(shlex.split(args.peer_start), capture_output=True, text=True,
                             timeout=60, check=True)
        pid = out.stdout.strip().split()[-1] if out.stdout.strip() else None

    def stop() -> None:
        if args.peer_stop:
            subprocess.run([*shlex.split(args.peer_stop), *([pid] if pid else [])], timeout=120, check=False)

    try:
        wait_models(args.peer_url, args.peer_ready_timeout)
    except BaseException:
        stop()
        raise
    return Server(args.peer_url, args.peer_key, args.peer_model, stop)


def wait_models(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"peer at {url} not ready (/v1/models) after {timeout:.0f}s")


# ---------------------------------------------------------------- load

def loadgen_python() -> str:
    feas = PEERS / "feas" / "bin" / "python"
    return str(feas) if feas.exists() else sys.executable


def run_workload(server: Server, workload: str, n: int, concurrency: int, args: argparse.Namespace) -> dict:
    # the shared generator's workloads too, short outputs checked
    gen = [str(LONG_LOADGEN), str(args.loadgen)]
    cmd = [loadgen_python(), *gen, "--url", server.url, "--key", server.key, "--model", server.model,
           "--workload", workload, "--n", str(n), "--concurrency", str(concurrency), "--json",
           "--timeout", str(args.request_timeout)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.workload_timeout, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"loadgen {workload} failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    # a failed or short request is never a fast one: no ratio from this run
    if res["errors"] or res["ok"] != n:
        raise RuntimeError(f"{server.url} {workload}: {res['errors']} of {n} requests failed or ended short "
                           f"({res.get('first_error')})")
    return res


def run_side(start: Side, sizes: dict[str, tuple[int, int]], args: argparse.Namespace) -> dict[str, dict]:
    server = start()
    try:
        return {w: run_workload(server, w, n, c, args) for w, (n, c) in sizes.items()}
    finally:
        server.stop()


# ---------------------------------------------------------------- result

def ratios(passes: list[dict[str, dict[str, dict]]]) -> dict[str, float | None]:
    """Median over passes of ours ÷ peer for each figure in RATIOS (None when a side has no figure)."""
    out: dict[str, float | None] = {}
    for name, (workload, field) in RATIOS.items():
        vals = []
        for p in passes:
            ours, peer = p["ours"].get(workload, {}).get(field), p["peer"].get(workload, {}).get(field)
            if isinstance(ours, int | float) and isinstance(peer, int | float) and peer > 0 and ours == ours:
                vals.append(ours / peer)
        out[name] = round(statistics.median(vals), 3) if vals else None
    return out


def resolved(args: argparse.Namespace) -> tuple[str, str]:
    """(dtype, quantization) the worker will actually use on this machine for `auto`."""
    import torch

    from worker.model.loader import pick_device, pick_dtype
    from worker.quant.weights import resolve_mode

    dev = pick_device(None)
    dt = pick_dtype(None if args.dtype == "auto" else args.dtype, dev)
    return str(dt).removeprefix("torch."), resolve_mode(args.quantization, torch.device(dev))


def compare(args: argparse.Namespace, ours: Side, peer: Side) -> dict:
    sizes = {w: nc for w, nc in (QUICK if args.quick else FULL).items()
             if not args.workloads or w in args.workloads}
    dtype, quantization = resolved(args)
    passes = []
    for i in range(args.passes):
        done: dict[str, dict] = {}
        for name, start in (("ours", ours), ("peer", peer)):
            done[name] = run_side(start, sizes, args)
            print(f"pass {i + 1} {name}: {json.dumps(done[name])}", file=sys.stderr, flush=True)
        passes.append(done)
    return {"bench": "vs_peer", "quick": args.quick, "cpu": cpu_model(), "cores": os.cpu_count(),
            "ours": {"model": args.model, "dtype": dtype, "quantization": quantization,
                     "threads": args.threads, "worker_args": args.worker_args},
            "peer": {"url": args.peer_url, "model": args.peer_model, "dtype": args.peer_dtype},
            "sizes": {w: {"n": n, "concurrency": c} for w, (n, c) in sizes.items()},
            "passes": passes, "ratios": ratios(passes)}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer-url", default="http://127.0.0.1:8101")
    ap.add_argument("--peer-model", default="smollm2")
    ap.add_argument("--peer-key", default="")
    ap.add_argument("--peer-dtype", default="bfloat16",
                    help="reported only: the peer's start command sets it")
    ap.add_argument("--peer-start", default=None, help="command that starts the peer and prints its PID "
                    "(e.g. ../shared/peers/start_vllm.sh)")
    ap.add_argument("--peer-stop", default=None,
                    help="command that stops it, given that PID (e.g. stop_vllm.sh)")
    ap.add_argument("--peer-ready-timeout", type=float, default=600.0)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--quantization", default="auto", choices=["none", "int8", "int4", "w8a8", "auto"])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the worker's torch threads")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="small n per workload (a smoke test, not a figure)")
    ap.add_argument("--workloads", nargs="*", choices=list(FULL), default=[],
                    help="run only these (default: all)")
    ap.add_argument("--worker-args", default="",
                    help="more worker flags for our side, e.g. '--spec-tokens 0'")
    ap.add_argument("--loadgen", type=Path, default=LOADGEN)
    ap.add_argument("--ready-timeout", type=float, default=300.0, help="our stack's start-up deadline")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--workload-timeout", type=float, default=1800.0)
    args = ap.parse_args(argv)
    if args.passes < 1:
        ap.error("--passes must be >= 1")
    if bool(args.peer_start) != bool(args.peer_stop):
        ap.error("--peer-start and --peer-stop go together (never leave a peer running)")
    if not args.loadgen.exists():
        ap.error(f"load generator {args.loadgen} not found (--loadgen)")
    return args


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the `finally`s that stop whichever side is up


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, _terminate)
    with tempfile.TemporaryDirectory(prefix="vs-peer-") as tmp:
        counter = iter(range(1_000))
        result = compare(args, lambda: start_ours(args, Path(tmp) / f"ours{next(counter)}"),
                         lambda: start_peer(args))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
