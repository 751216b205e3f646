"""The processes of `bench/engines.py`: Redis, a Switchyard worker, a vLLM-engine worker publishing vLLM KV
events, a gateway indexing them; and vLLM's own OpenAI server on the same engine flags."""

from __future__ import annotations

import contextlib
import shlex
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from config.local_stack.launcher import GatewayProc, WorkerProc, free_port, start_redis_server
from worker.vllm_engine.launch import engine_argv

VLLM_WORKER_ID, SWITCHYARD_WORKER_ID = "vllm-engine", "switchyard-engine"
READY_S = 900.0


class EngineFleet:
    """Both kinds of worker behind one gateway (the vLLM-engine worker's CPU threads on core 1)."""

    def __init__(self, logs: Path, model: Path, dtype: str, engine_args: str, block: int) -> None:
        self.logs = logs
        self.redis, self.redis_url = start_redis_server(logs / "redis.log")
        pub, replay = free_port(), free_port()
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                  "replay_endpoint": f"tcp://*:{replay}", "topic": "kv"}
        vllm_args = f"{engine_args} --kv-events-config {shlex.quote(_json(events))}"
        self.switchyard = WorkerProc(logs, model=str(model), worker_id=SWITCHYARD_WORKER_ID, extra=[
            "--dtype", dtype, "--block-size", str(block), "--kv-cache-bytes", str(1 << 30)])
        self.vllm = WorkerProc(logs, model=str(model), worker_id=VLLM_WORKER_ID, extra=["--dtype", dtype],
                               vllm_args=vllm_args)
        config = logs / "gateway.toml"
        config.write_text(
            "[gateway]\nworker_timeout = 60.0\nstream_detach_grace = 0.0\n"
            f"block_size = {block}\nworkers = [\"{self.switchyard.endpoint}\", \"{self.vllm.endpoint}\"]\n"
            f"[[gateway.kv_event_feeds]]\nworker_id = \"{self.vllm.endpoint}\"\n"  # static: the endpoint
            f"endpoint = \"tcp://127.0.0.1:{pub}\"\nreplay_endpoint = \"tcp://127.0.0.1:{replay}\"\n"
            "hashes = \"vllm\"\n")
        self.gateway = GatewayProc.spawn(logs, ["--config", str(config), "--redis-url", self.redis_url,
                                                "--model", str(model)])

    @property
    def base_url(self) -> str:
        return self.gateway.base_url

    def __enter__(self) -> EngineFleet:
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_S
        while not (self.gateway.ready() and all("listening on" in w.log_text()
                                                for w in (self.switchyard, self.vllm))):
            for proc in (self.switchyard.proc, self.vllm.proc, self.gateway.proc):
                if proc.poll() is not None:
                    raise RuntimeError(f"a fleet process exited during start-up (logs: {self.logs})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the fleet is not ready after {READY_S}s (logs: {self.logs})")
            time.sleep(0.5)
        time.sleep(1.0)  # stats frames from both: the gateway knows them

    def tenant(self, name: str) -> str:
        from tenancy import tenant_with_new_key

        return tenant_with_new_key(self.redis_url, name, max_concurrent=100)

    def feed_counts(self) -> dict[str, float]:
        """The gateway's indexed blocks per worker (the vLLM-engine worker's come from its KV events)."""
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("switchyard_router_kv_index_blocks{"):
                series, _, value = line.rpartition(" ")
                out[series.split('worker="', 1)[-1].split('"', 1)[0]] = float(value)
        return out

    def stop_switchyard_worker(self) -> None:
        self.switchyard.stop(grace=20)
        time.sleep(2.0)  # the gateway sees it gone (its link drops at once; stats stop)

    def close(self) -> None:
        self.gateway.stop()
        for w in (self.switchyard, self.vllm):
            w.stop(grace=20)
        self.redis.terminate()
        self.redis.wait(timeout=10)


@contextlib.contextmanager
def vllm_serve(logs: Path, model: Path, dtype: str, engine_args: str, port: int) -> Iterator[None]:
    """`vllm serve` on 127.0.0.1:`port` with the flags a vLLM-engine worker gives its engine; stopped
    after."""
    flags = engine_argv(str(model), dtype, engine_args)[2:]  # the model goes first, positionally
    code = ("import sys\nfrom worker.vllm_engine.launch import alias_cpu_wheel\nalias_cpu_wheel()\n"
            "from vllm.entrypoints.cli.main import main\nsys.argv = ['vllm'] + sys.argv[1:]\nmain()\n")
    argv = [sys.executable, "-c", code, "serve", str(model), "--served-model-name", "default", "--host",
            "127.0.0.1", "--port", str(port), "--enable-prompt-tokens-details", *flags]
    with open(logs / "vllm-serve.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + READY_S
        while not _answers(f"http://127.0.0.1:{port}/v1/models"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not start (log: {logs / 'vllm-serve.log'})")
            time.sleep(1.0)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _json(value: object) -> str:
    import json

    return json.dumps(value, separators=(",", ":"))
