"""One gateway over a Switchyard worker and a vLLM-engine worker run tensor-parallel over 2 ranks (one core
each), both on the same seeded fp32 weights: vLLM's parallelism flags pass through, both engines give the same
greedy tokens, and streams cut by a SIGKILLed Switchyard worker finish whole on the vLLM-engine worker."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from config.local_stack.launcher import GatewayProc, WorkerProc
from tests.faults.client import metric
from tests.faults.test_resume import _assert_whole, run_streams

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

STREAMS, MAX_TOKENS = 6, 300


class Fleet:
    def __init__(self, log_dir: Path, model: Path, redis_url: str) -> None:
        self.redis_url = redis_url
        self.switchyard = WorkerProc(log_dir, model=str(model), extra=["--dtype", "float32"])
        self.vllm = WorkerProc(log_dir, model=str(model), extra=["--dtype", "float32"],
                               vllm_args="--tensor-parallel-size 2 --max-model-len 2048")
        config = log_dir / "gateway.toml"
        endpoints = ", ".join(f'"{w.endpoint}"' for w in (self.switchyard, self.vllm))
        config.write_text("[gateway]\nworker_timeout = 30.0\nstream_detach_grace = 0.0\n"
                          f"workers = [{endpoints}]\n")
        self.gateway = GatewayProc.spawn(log_dir, ["--config", str(config), "--redis-url", redis_url,
                                                   "--model", str(model)])

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not (self.gateway.ready() and self._both_serving()):
            for proc, name in ((self.switchyard.proc, "switchyard"), (self.vllm.proc, "vllm"),
                               (self.gateway.proc, "gateway")):
                assert proc.poll() is None, f"the {name} process exited during start-up"
            assert time.monotonic() < deadline, "the fleet is not ready"
            time.sleep(0.5)

    def _both_serving(self) -> bool:
        if not all("listening on" in w.log_text() for w in (self.switchyard, self.vllm)):
            return False
        time.sleep(1.0)  # a few stats frames: the gateway knows both
        return True

    def stop(self) -> None:
        self.gateway.stop()
        for w in (self.switchyard, self.vllm):
            w.stop(grace=20)


@pytest.fixture(scope="module")
def fleet(redis_server, vllm_env: None) -> Iterator[Fleet]:  # noqa: ANN001 - tests/conftest.py's RedisServer
    logs = Path(tempfile.mkdtemp(prefix="sy-vllm-fleet-"))
    model = logs / "tiny-random-vllm"
    subprocess.run([sys.executable, "-m", "worker.vllm_engine.hf_folder", "tiny-random-vllm", str(model)],
                   check=True, timeout=300, capture_output=True)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # a core per tensor-parallel rank
        fleet = Fleet(logs, model, redis_server.url)
        try:
            fleet.wait_ready(900)
            yield fleet
        finally:
            fleet.stop()


def _key(fleet: Fleet, name: str) -> str:
    from tenancy import tenant_with_new_key

    return tenant_with_new_key(fleet.redis_url, name, max_concurrent=100)


def test_tensor_parallel_flags_reach_vllm(fleet: Fleet):
    log = fleet.vllm.log_text()
    assert "vLLM engine: tensor_parallel_size=2 pipeline_parallel_size=1 dtype=torch.float32" in log
    assert "world_size=2" in log  # vLLM's own words: two ranks


def test_both_engines_answer_alike_and_streams_carry_over_from_one_to_the_other(fleet: Fleet):
    key, base = _key(fleet, "mixed"), fleet.gateway.base_url
    want = asyncio.run(run_streams(base, key, streams=STREAMS, timeout=300))  # on both engines
    assert all(w["error"] is None and w["usage"]["completion_tokens"] == MAX_TOKENS for w in want)
    resumes = metric(base, "switchyard_router_resumes_total", 'reason="worker_lost"')
    got = asyncio.run(run_streams(base, key, fleet.switchyard.proc.kill, STREAMS, 300))
    _assert_whole(got, want)  # the same text and usage as the undisturbed run, whichever engine served it
    assert metric(base, "switchyard_router_resumes_total", 'reason="worker_lost"') > resumes


def test_a_dead_vllm_engine_process_ends_the_worker(fleet: Fleet):
    """Last: SIGKILL of vLLM's engine process. The worker exits (code 3) instead of answering every request
    with an error; with no worker left, a stream in flight ends with an error event, not silence."""
    import psutil

    key, base = _key(fleet, "core-death"), fleet.gateway.base_url
    children = psutil.Process(fleet.vllm.proc.pid).children()
    named = [c for c in children if "EngineCore" in c.name() + " ".join(c.cmdline())]
    core = (named or [c for c in children if c.children()])[0]  # else: the one whose children are the ranks
    got = asyncio.run(run_streams(base, key, core.kill, streams=2, timeout=120))
    assert fleet.vllm.proc.wait(timeout=60) == 3
    assert all(g["error"] is not None for g in got)
    assert "the vLLM engine process died" in fleet.vllm.log_text()
