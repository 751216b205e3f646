"""The two systems `bench/vs_peer.py` compares, one configuration at a time: starting and stopping each,
sending it the load generators' workloads (closed loop and open loop), and reading our worker's speculation
counters. A helper module: no targets of its own."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PEERS = Path(os.environ.get("PEERS", Path.home() / ".cache" / "peers"))
# ../shared/peers/loadgen.py next to the checkout (or next to its worktrees' folder)
LOADGEN = next((p for p in (REPO.parent / "shared" / "peers" / "loadgen.py",
                            REPO.parent.parent / "shared" / "peers" / "loadgen.py") if p.exists()),
               REPO.parent / "shared" / "peers" / "loadgen.py")
LONG_LOADGEN = Path(__file__).with_name("long_loadgen.py")
OPEN_LOOP = Path(__file__).with_name("open_loop.py")
UNLIMITED = {"tpm": 0, "rpm": 0, "max_concurrent": 0, "max_tokens": 4096}
SPEC_COUNTERS = ("switchyard_worker_spec_proposed_tokens_total",
                 "switchyard_worker_spec_accepted_tokens_total")


@dataclass(slots=True)
class Config:
    """One system in one configuration, as the JSON line names it."""

    system: str  # "ours" or "peer"
    label: str  # "matched", "best", "best_nospec", "peer"
    dtype: str
    quantization: str
    kv_dtype: str
    speculation: bool
    worker_args: list[str] = field(default_factory=list)  # ours: the worker's flags
    peer_env: dict[str, str] = field(default_factory=dict)  # peer: the start command's environment

    def describe(self) -> dict:
        out = {"system": self.system, "dtype": self.dtype, "quantization": self.quantization,
               "kv_dtype": self.kv_dtype, "speculation": self.speculation}
        return out | ({"worker_args": shlex.join(self.worker_args)} if self.system == "ours" else {})


class Server:
    """A running system under test: where to send load, how to stop it, and (ours) its worker's metrics."""

    def __init__(self, url: str, key: str, model: str, stop: Callable[[], None],
                 metrics_url: str | None = None) -> None:
        self.url, self.key, self.model, self._stop = url, key, model, stop
        self.metrics_url = metrics_url

    def stop(self) -> None:
        self._stop()


def start_ours(config: Config, model: str, ready_timeout: float, log_dir: Path) -> Server:
    """One worker and one gateway through the project's launcher, a demo tenant with no limits, and the
    worker's Prometheus port for the speculation counters."""
    from config.local_stack.launcher import DEMO_TENANT, Stack, StackConfig, free_port

    metrics_port = free_port()
    stack = Stack(StackConfig(port=free_port(), model=model, ready_timeout=ready_timeout, log_dir=log_dir,
                              worker_args=[*config.worker_args, "--metrics-port", str(metrics_port)]))
    stack.start()
    try:
        key = stack.create_tenant(DEMO_TENANT, **UNLIMITED)
    except BaseException:
        stack.stop()
        raise
    return Server(stack.base_url, key, model, stack.stop, f"http://127.0.0.1:{metrics_port}/metrics")


def start_peer(config: Config, url: str, key: str, model: str, start_cmd: str | None, stop_cmd: str | None,
               ready_timeout: float) -> Server:
    """The peer at `url`, started by `start_cmd` (which prints a PID) with the config's environment when
    given, ready on /v1/models; stopped by `stop_cmd` with that PID."""
    pid = None
    if start_cmd:
        out = subprocess.run(shlex.split(start_cmd), capture_output=True, text=True, timeout=60, check=True,
                             env={**os.environ, **config.peer_env})
        pid = out.stdout.strip().split()[-1] if out.stdout.strip() else None

    def stop() -> None:
        if stop_cmd:
            subprocess.run([*shlex.split(stop_cmd), *([pid] if pid else [])], timeout=120, check=False)

    try:
        wait_models(url, ready_timeout)
    except BaseException:
        stop()
        raise
    return Server(url, key, model, stop)


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


def loadgen_python() -> str:
    feas = PEERS / "feas" / "bin" / "python"
    return str(feas) if feas.exists() else sys.executable


def _checked(server: Server, what: str, out: subprocess.CompletedProcess, n: int) -> dict:
    if out.returncode not in (0, 1) or not out.stdout.strip():
        raise RuntimeError(f"{what} failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    ok, errors = res.get("ok", n), res.get("errors", 0)
    # a failed or short request is never a fast one: no ratio from this run
    if out.returncode != 0 or errors or ok != n:
        raise RuntimeError(f"{server.url} {what}: {errors} of {n} requests failed or ended short "
                           f"({res.get('first_error')})")
    return res


def run_workload(server: Server, workload: str, n: int, concurrency: int, loadgen: Path,
                 request_timeout: float, workload_timeout: float, seed: int = 1) -> dict:
    """One closed-loop workload through the shared generator (with `bench/long_loadgen.py`'s workloads);
    its figures and the digest of the prompts it sent."""
    cmd = [loadgen_python(), str(LONG_LOADGEN), str(loadgen), "--url", server.url, "--key", server.key,
           "--model", server.model, "--workload", workload, "--n", str(n), "--concurrency", str(concurrency),
           "--json", "--timeout", str(request_timeout), "--seed", str(seed)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=workload_timeout, check=False)
    res = _checked(server, f"loadgen {workload}", out, n)
    digest = re.search(r"prompts_sha256 ([0-9a-f]{64})", out.stderr)
    return res | {"prompts_sha256": digest.group(1) if digest else None}


def run_open_loop(server: Server, workload: str, rates: list[float], n: int, slo_ttft_ms: float,
                  slo_tpot_ms: float, loadgen: Path, request_timeout: float, workload_timeout: float) -> dict:
    """Poisson arrivals at each rate (`bench/open_loop.py`): per-rate figures and the best goodput."""
    cmd = [loadgen_python(), str(OPEN_LOOP), str(loadgen), "--url", server.url, "--key", server.key,
           "--model", server.model, "--workload", workload, "--rates", ",".join(f"{r:.3f}" for r in rates),
           "--n", str(n), "--slo-ttft-ms", str(slo_ttft_ms), "--slo-tpot-ms", str(slo_tpot_ms),
           "--timeout", str(request_timeout)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=workload_timeout, check=False)
    res = _checked(server, f"open loop {workload}", out, n)
    bad = [r for r in res["rates"] if r["errors"] or r["ok"] != n]
    if bad:
        raise RuntimeError(f"{server.url} open loop at {bad[0]['rate']}/s: {bad[0]['errors']} errors")
    return res


def spec_counters(metrics_url: str | None) -> tuple[float, float] | None:
    """(proposed, accepted) draft tokens from our worker's /metrics, or None for the peer."""
    if metrics_url is None:
        return None
    from bench.fairness import worker_metric

    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    proposed, accepted = (worker_metric(text, name) for name in SPEC_COUNTERS)
    return proposed, accepted
