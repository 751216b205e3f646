"""Disaggregated prefill end to end: a gateway, a decode worker and a prefill worker (tiny fp32 model, real
processes). Completions match a worker that prefills itself, and a SIGKILL of the prefill worker while it is
pushing pages loses no request."""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from config.local_stack.launcher import Stack, StackConfig, WorkerProc, free_port
from worker.config import EngineConfig
from worker.engine.core import Engine
from worker.model.tiny_model import load_tiny_model
from worker.protocol import SamplingParams

WORKER = ["--model", "tiny-random", "--dtype", "float32", "--quantization", "none", "--kv-dtype", "model",
          "--metrics-host", "127.0.0.1"]


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[Stack, WorkerProc, int, str]]:
    logs = Path(tempfile.mkdtemp(prefix="sy-disagg-"))
    decode_metrics = free_port()
    # small prefill steps: a long prompt takes many steps, so a kill lands while pages are being pushed
    prefill = WorkerProc(logs, model="tiny-random", extra=[*WORKER, "--role", "prefill", "--dtype", "float32",
                                                           "--max-num-batched-tokens", "16"])
    stack = Stack(StackConfig(port=free_port(), log_dir=logs, ready_timeout=240.0,
                              worker_args=[*WORKER, "--role", "decode", "--metrics-port", str(decode_metrics),
                                           "--disagg-stall-s", "3"]))
    stack.config.gateway_args = ["--workers", f"{stack.worker_endpoint},{prefill.endpoint}",
                                 "--disagg-min-tokens", "32", "--worker-timeout", "2"]
    try:
        stack.start()
        key = stack.create_tenant("disagg", max_concurrent=64)
        until = time.monotonic() + 120
        while _series(stack.base_url, "switchyard_router_prefix_hit_rate") < 2:  # both workers heard
            assert time.monotonic() < until, "the prefill worker did not join"
            time.sleep(0.25)
        yield stack, prefill, decode_metrics, key
    finally:
        prefill.stop()
        stack.stop()


def _count(url: str, name: str, label: str = "") -> float:
    """The sum of `name`'s samples whose labels contain `label` (every sample when empty)."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^" + re.escape(name) + r"(\{[^}]*\})? (\S+)$", line)
        if m and label in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def _series(url: str, name: str) -> int:
    return sum(line.startswith(name + "{")
               for line in httpx.get(url + "/metrics", timeout=10).text.splitlines())


def _mid_transfer(gateway_url: str, decode_url: str, bytes_before: float) -> bool:
    """Pages reached the decode worker since `bytes_before`; fewer transfers ended than the gateway began."""
    remote = _count(gateway_url, "switchyard_disagg_requests_total", 'outcome="remote"')
    ended = _count(decode_url, "switchyard_worker_disagg_transfers_total")
    return (_count(decode_url, "switchyard_worker_disagg_received_bytes_total") > bytes_before
            and ended < remote)


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 20_000, (n,), generator=g).tolist()


def complete(base: str, key: str, tokens: list[int], max_tokens: int = 12) -> dict:
    r = httpx.post(base + "/v1/completions", headers={"authorization": f"Bearer {key}"}, timeout=120,
                   json={"model": "default", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
                         "ignore_eos": True})
    r.raise_for_status()
    return r.json()


def test_disaggregated_completions_match_a_worker_prefilling_itself(fleet) -> None:
    stack, _, decode_metrics, key = fleet
    decode_url = f"http://127.0.0.1:{decode_metrics}"
    remote = _count(stack.base_url, "switchyard_disagg_requests_total", 'outcome="remote"')
    complete_before = _count(decode_url, "switchyard_worker_disagg_transfers_total", 'outcome="complete"')
    prompts = [prompt(i, 150 + 37 * i) for i in range(3)]
    outs = [complete(stack.base_url, key, p) for p in prompts]
    engine = Engine(load_tiny_model(dtype="float32", device="cpu"), EngineConfig(kv_host_bytes=0))
    try:
        want = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    finally:
        engine.close()
    for out, ref in zip(outs, want, strict=True):
        assert out["choices"][0]["text"] == engine.tokenizer.decode(ref)
        assert out["usage"]["completion_tokens"] == 12
    assert _count(stack.base_url, "switchyard_disagg_requests_total", 'outcome="remote"') >= remote + 3
    assert _count(decode_url, "switchyard_worker_disagg_transfers_total", 'outcome="complete"') >= \
        complete_before + 3


def test_sigkill_of_the_prefill_worker_mid_transfer_loses_no_request(fleet) -> None:
    stack, prefill, decode_metrics, key = fleet
    decode_url = f"http://127.0.0.1:{decode_metrics}"
    prompts = [prompt(100 + i, 2000) for i in range(8)]
    received = _count(decode_url, "switchyard_worker_disagg_received_bytes_total")
    fallbacks = _count(decode_url, "switchyard_worker_disagg_fallbacks_total")
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(complete, stack.base_url, key, p, 8) for p in prompts]
        until = time.monotonic() + 30
        # pages arriving, not every transfer done
        while not _mid_transfer(stack.base_url, decode_url, received):
            assert time.monotonic() < until, "no transfer was seen in flight"
            time.sleep(0.005)
        prefill.proc.kill()
        outs = [f.result(timeout=120) for f in futures]
    for out in outs:
        assert out["usage"]["completion_tokens"] == 8 and out["choices"][0]["finish_reason"] == "length"
    # the kill landed while transfers were open: seen as a dropped link, or (a lease after the drop) a stall
    lost = _count(decode_url, "switchyard_worker_disagg_fallbacks_total", 'reason="prefill_lost"')
    stalled = _count(decode_url, "switchyard_worker_disagg_fallbacks_total", 'reason="stall"')
    assert lost + stalled >= 1 and _count(decode_url, "switchyard_worker_disagg_fallbacks_total") > fallbacks
    # the decode worker is idle again and serves the next request itself
    assert complete(stack.base_url, key, prompt(999, 300))["usage"]["completion_tokens"] == 12
    until = time.monotonic() + 10
    while _count(decode_url, "switchyard_worker_running_requests") + \
            _count(decode_url, "switchyard_worker_waiting_requests") > 0:
        assert time.monotonic() < until
        time.sleep(0.1)


def test_a_restarted_prefill_worker_is_used_again(fleet) -> None:
    stack, prefill, decode_metrics, key = fleet
    if prefill.proc.poll() is None:
        prefill.proc.kill()  # run alone: the kill test has not run
    prefill.proc.wait(10)
    logs = Path(tempfile.mkdtemp(prefix="sy-disagg-restart-"))
    again = WorkerProc(logs, model="tiny-random", port=prefill.port,
                       extra=[*WORKER, "--role", "prefill", "--max-num-batched-tokens", "16"])
    try:
        decode_url = f"http://127.0.0.1:{decode_metrics}"
        done = _count(decode_url, "switchyard_worker_disagg_transfers_total", 'outcome="complete"')
        until = time.monotonic() + 60
        while True:  # the gateway reconnects and the decode worker's link reconnects to the same endpoint
            complete(stack.base_url, key, prompt(int(time.monotonic() * 1000) % 10_000, 200))
            if _count(decode_url, "switchyard_worker_disagg_transfers_total", 'outcome="complete"') > done:
                break
            assert time.monotonic() < until, "no transfer completed with the restarted prefill worker"
            time.sleep(0.5)
    finally:
        again.stop()
