"""`make run`: a private Switchyard stack on this machine, stopped with Ctrl-C.

Redis (unless given), one worker and one gateway, plus a demo tenant's key; the worker link is secured
by the configured cluster key or a fresh one per run. `Stack` runs the same processes for the end-to-end
tests and the benchmarks; `WorkerProc` and `GatewayProc` start one worker or gateway on its own (router,
admission and fault tests, bench/routing.py).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
DEMO_TENANT = "demo"
CLUSTER_KEY_ENV = "SWITCHYARD_CLUSTER_SECRET_KEY"
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
_PR_SET_PDEATHSIG = 1


def _tied_to(parent: int) -> Callable[[], None]:
    """A child's set-up before exec: the stop signals unblocked (the launcher blocks them), and SIGTERM sent
    to it when `parent` dies, however it dies (Linux's PR_SET_PDEATHSIG; if the parent is gone already, it
    ends)."""
    def setup() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)
    return setup


def cluster_key_for_run() -> str:
    """The configured cluster key, or a fresh CURVE secret key for this run only."""
    import zmq

    return os.environ.get(CLUSTER_KEY_ENV) or zmq.curve_keypair()[1].decode()


_HANDED_OUT: deque[int] = deque(maxlen=4096)  # ports `free_port` gave this process, newest last


def free_port() -> int:
    """A loopback port free now and not handed out by this process before: the kernel may give the same free
    port to two binds in a row, and two children told to listen on it race (one fails with EADDRINUSE)."""
    for _ in range(64):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.append(port)
            return port
    raise RuntimeError("no fresh loopback port after 64 tries")


def redis_argv(binary: str, port: int) -> list[str]:
    """A private redis-server on loopback that keeps nothing on disk."""
    return [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--daemonize", "no", "--loglevel", "warning"]


def start_redis_server(log_path: Path | None = None) -> tuple[subprocess.Popen, str]:
    """A private redis-server (`redis_argv`) on a fresh port, listening, and its URL (for benchmarks)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found: install it (make redis-bin)")
    port = free_port()
    with open(log_path or os.devnull, "ab") as log:
        proc = subprocess.Popen(redis_argv(binary, port), stdout=log, stderr=subprocess.STDOUT)
    wait_for_port(port, 10.0)
    return proc, f"redis://127.0.0.1:{port}/0"


def wait_for_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on port {port} after {timeout}s")


@dataclass(slots=True)
class StackConfig:
    port: int = 8000
    redis_url: str | None = None  # None: start a private redis-server
    model: str = "default"
    worker_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    ready_timeout: float = 180.0
    log_dir: Path | None = None  # None: children inherit this process's stdout/stderr
    # z85 CURVE secret key given to worker and gateway; None: the environment's
    cluster_key: str | None = None


class Stack:
    """Redis (optional), one worker and one gateway as child processes."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.procs: dict[str, subprocess.Popen] = {}
        self.redis_url = config.redis_url
        self.worker_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.base_url = f"http://127.0.0.1:{config.port}"
        self.pause: Callable[[float], None] = time.sleep  # between readiness polls (`main` wakes on a signal)
        self.tie_children = False  # `main`: children die with this process (`_tied_to`)

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        out = None
        if self.config.log_dir is not None:
            self.config.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.config.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "SWITCHYARD_DEV_STACK": "1"}
        if self.config.cluster_key is not None:  # by environment, never on a command line
            env[CLUSTER_KEY_ENV] = self.config.cluster_key
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT if out else None, env=env,
                                start_new_session=True,
                                preexec_fn=_tied_to(os.getpid()) if self.tie_children else None)
        if out is not None:
            out.close()
        self.procs[name] = proc
        return proc

    def start(self) -> None:
        try:
            if self.redis_url is None:
                self._start_redis()
            cli = [sys.executable, "-m", "config.cli"]
            # one worker: nobody to hand streams to on SIGTERM, so they finish in place (--drain-handoff -1)
            self._spawn("worker", [*cli, "worker", "--model", self.config.model, "--bind",
                                   self.worker_endpoint, "--redis-url", self.redis_url, "--drain-handoff",
                                   "-1", *self.config.worker_args])
            self._spawn("gateway", [*cli, "gateway", "--port", str(self.config.port), "--redis-url",
                                    self.redis_url, "--workers", self.worker_endpoint, "--model",
                                    self.config.model, "--worker-timeout", "10", *self.config.gateway_args])
            self.wait_ready(self.config.ready_timeout)
        except BaseException:
            self.stop()
            raise

    def _start_redis(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found: install it (make run does) or set "
                               "SWITCHYARD_REDIS_URL")
        port = free_port()
        self._spawn("redis", redis_argv(binary, port))
        wait_for_port(port, 10.0)
        self.redis_url = f"redis://127.0.0.1:{port}/0"

    def dead(self) -> list[str]:
        return [name for name, p in self.procs.items() if p.poll() is not None]

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.dead():
                raise RuntimeError(f"{', '.join(self.dead())} exited during start-up")
            try:
                with urllib.request.urlopen(self.base_url + "/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            self.pause(0.25)
        raise TimeoutError(f"gateway not ready after {timeout}s")

    def create_tenant(self, name: str = DEMO_TENANT, **fields: object) -> str:
        """Create (or update) tenant `name` and return a fresh API key for it."""
        from tenancy import tenant_with_new_key

        assert self.redis_url is not None
        return tenant_with_new_key(self.redis_url, name, **fields)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every child (gateway first, Redis last), then SIGKILL what is left after `timeout`."""
        order = [n for n in ("gateway", "worker", "redis") if n in self.procs]
        for name in order:
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self.procs.clear()


class WorkerProc:
    """One `switchyard worker` process on a free loopback port, stopped for sure (SIGTERM, then SIGKILL)."""

    def __init__(self, log_dir: Path, *, model: str = "tiny-random", extra: list[str] | None = None,
                 redis_url: str | None = None, worker_id: str | None = None, threads: int = 1,
                 port: int | None = None, vllm_args: str | None = None) -> None:
        self.port = port or free_port()  # a restarted worker may take its old port back
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"worker-{self.port}.log"
        # tests and benchmarks: unquantized weights and model-dtype KV unless `extra` says otherwise (a later
        # flag wins), so outputs compare across workers and with in-process engines
        # `vllm_args`: a vLLM-engine worker with these engine flags (its threads and memory are vLLM's)
        engine = ["--num-threads", str(threads), "--kv-cache-bytes", str(64 << 20), "--quantization", "none",
                  "--kv-dtype", "model"]
        if vllm_args is not None:
            engine = ["--engine", "vllm", "--engine-args", vllm_args]
        cmd = [sys.executable, "-m", "config.cli", "worker", "--model", model, "--bind", self.endpoint,
               *engine, *(extra or [])]
        if redis_url:
            cmd += ["--redis-url", redis_url]
        if worker_id:
            cmd += ["--worker-id", worker_id]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads),
                   TOKENIZERS_PARALLELISM="false")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=_REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self, grace: float = 5.0) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=5)
        finally:
            self._log.close()


@dataclass(slots=True)
class GatewayProc:
    """One `switchyard gateway` process on a free loopback port (tests and benchmarks)."""

    port: int
    proc: subprocess.Popen
    log_path: Path

    @classmethod
    def spawn(cls, log_dir: Path, args: list[str], port: int | None = None) -> GatewayProc:
        port = port or free_port()
        log_path = log_dir / f"gateway-{port}.log"
        cmd = [sys.executable, "-m", "config.cli", "gateway", "--port", str(port), *args]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, cwd=_REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        return cls(port, proc, log_path)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/ready", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=5)

    def stop(self, grace: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def curl_line(base_url: str, key: str, model: str) -> str:
    body = json.dumps({"model": model,
                       "messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 32, "temperature": 0})
    return (f"curl -s {base_url}/v1/chat/completions -H 'Authorization: Bearer {key}' "
            f"-H 'Content-Type: application/json' -d '{body}'")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m config.local_stack.launcher",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    p.add_argument("--model", default=os.environ.get("SWITCHYARD_MODEL", "default"))
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--log-dir", type=Path, default=None, help="write child logs here instead of the terminal")
    return p.parse_args(argv)


def _pause_until_signal(seconds: float) -> None:
    """Sleep, but a pending SIGINT or SIGTERM (blocked, so delivered only here) ends it as a
    KeyboardInterrupt."""
    if signal.sigtimedwait(STOP_SIGNALS, seconds) is not None:
        raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Start the stack, print the demo key, and stop everything on SIGINT or SIGTERM. The stop signals stay
    blocked for the whole run and are taken only at the waits (`_pause_until_signal`), so no signal can land
    inside the stop itself: a second SIGTERM or Ctrl-C during it changes nothing, and the children die with
    this process even when it is SIGKILLed (`_tied_to`)."""
    args = _parse(argv)
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    stack = Stack(StackConfig(port=args.port, redis_url=os.environ.get("SWITCHYARD_REDIS_URL") or None,
                              model=args.model, ready_timeout=args.ready_timeout, log_dir=args.log_dir,
                              cluster_key=cluster_key_for_run()))
    stack.pause, stack.tie_children = _pause_until_signal, True
    try:
        print(f"starting Switchyard (redis, worker, gateway on port {args.port}); this takes a minute...",
              flush=True)
        stack.start()
        key = stack.create_tenant(DEMO_TENANT)
        print(f"\nSwitchyard is ready at {stack.base_url}\ndemo tenant key: {key}\n\n"
              f"{curl_line(stack.base_url, key, 'default')}\n\nCtrl-C stops everything.", flush=True)
        while not stack.dead():
            _pause_until_signal(0.5)
        print(f"{', '.join(stack.dead())} exited; stopping the rest", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopping Switchyard (gateway, worker, redis)...", file=sys.stderr, flush=True)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"make run: {exc}", file=sys.stderr)
        return 1
    finally:
        stack.stop()


if __name__ == "__main__":
    raise SystemExit(main())
