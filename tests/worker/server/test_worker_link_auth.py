"""The worker port's link authentication with real processes: CurveZMQ under the cluster key refuses
plain and forged peers, and a worker refuses to open a non-loopback port without a key."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from config.local_stack.launcher import WorkerProc
from router.links.client import WorkerClient, WorkerError
from tests import REPO
from tests.worker.server.test_worker_process import LONG, READY_TIMEOUT, collect
from worker import protocol as p
from worker.protocol import SamplingParams


def _keyed_worker(tmp_path: Path, key: str, **kw: object) -> WorkerProc:
    config = tmp_path / "cluster.toml"
    config.write_text(f'cluster_secret_key = "{key}"\n')
    return WorkerProc(tmp_path, extra=["--config", str(config)], **kw)  # type: ignore[arg-type]


async def _frames_within(sock: zmq.asyncio.Socket, seconds: float) -> list[bytes]:
    got: list[bytes] = []
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            while True:
                got.append(await sock.recv())
    return got


async def test_worker_port_needs_the_cluster_key(tmp_path: Path) -> None:
    """CURVE on the worker port: only a client holding the cluster key pair is heard or answered."""
    public, secret = zmq.curve_keypair()
    worker = _keyed_worker(tmp_path, secret.decode())
    ctx = zmq.asyncio.Context()
    intruders: list[zmq.asyncio.Socket] = []
    good = WorkerClient(worker.endpoint, gateway_id="keyed", context=ctx, worker_timeout=3.0,
                        cluster_key=secret.decode())
    await good.start()
    try:
        try:
            await good.wait_ready(READY_TIMEOUT)
        except WorkerError:
            pytest.fail("keyed worker not ready:\n" + worker.log_text())
        plain = ctx.socket(zmq.DEALER)  # no CURVE at all
        other_public, other_secret = zmq.curve_keypair()
        forged = ctx.socket(zmq.DEALER)  # CURVE with the server's public key but its own key pair
        forged.curve_serverkey, forged.curve_publickey, forged.curve_secretkey = \
            public, other_public, other_secret
        for sock in (plain, forged):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, b"keyed")  # even a known routing id gets nothing
            sock.connect(worker.endpoint)
            intruders.append(sock)
            for frame in (p.encode_hello("intruder"),
                          p.encode_gen(f"x-{len(intruders)}", b"", [5, 6, 7], LONG)):
                # a refused handshake can drop the socket's only pipe; then a send waits for a peer forever
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(sock.send(frame), 1.0)
        busy = []
        loop = asyncio.get_running_loop()
        until = loop.time() + 2.0
        while loop.time() < until:
            assert good.stats is not None
            busy.append(good.stats.running + good.stats.queue)
            await asyncio.sleep(0.1)
        assert set(busy) == {0}, "work submitted without the cluster key was run"
        for sock in intruders:
            assert await _frames_within(sock, 0.5) == []
        tokens, finish = await asyncio.wait_for(collect(good, "ok", [5, 6, 7],
                                                        SamplingParams(max_tokens=4)), 30)
        assert len(tokens) == 4 and finish == "length"
        assert secret.decode() not in worker.log_text()
    finally:
        for sock in intruders:
            sock.close()
        await good.close()
        ctx.destroy(linger=0)
        worker.stop()


def test_worker_refuses_an_open_port_without_a_key(tmp_path: Path) -> None:
    worker = WorkerProc(tmp_path)
    worker.stop()  # only its port and log path are used
    cmd = [sys.executable, "-m", "config.cli", "worker", "--model", "tiny-random", "--bind",
           f"tcp://0.0.0.0:{worker.port}"]
    env = {k: v for k, v in __import__("os").environ.items() if k != "SWITCHYARD_CLUSTER_SECRET_KEY"}
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "SWITCHYARD_CLUSTER_SECRET_KEY" in out.stderr
