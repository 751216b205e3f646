"""A flood of `gen` frames must not silence a worker: its loop admits frames for at most 50 ms at a time, so
`stats` frames keep going out while thousands of frames are admitted (before, one drain took up to 4,096
frames, about a second here, with no stats in between)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from config.local_stack.launcher import WorkerProc
from worker import protocol as p

pytestmark = pytest.mark.timeout(120)
FRAMES = 4000
# stats every 100 ms (drains end when they are due, the pulse covers a step); slack for 2 loaded cores
MAX_STATS_GAP_S = 0.35


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProc]:
    proc = WorkerProc(Path(tmp_path_factory.mktemp("flood")), extra=["--gateway-timeout", "1.5"])
    try:
        yield proc
    finally:
        proc.stop()


def _stats_times(sock: zmq.Socket, until: float) -> list[float]:
    times = []
    while time.monotonic() < until:
        if sock.poll(20):
            frame = p.decode_worker_frame(sock.recv())
            if isinstance(frame, p.WorkerStats):
                times.append(time.monotonic())
    return times


def test_stats_keep_flowing_while_a_flood_of_frames_is_admitted(worker: WorkerProc) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    try:
        sock.connect(worker.endpoint)
        sock.send(p.encode_hello("flood-test"))
        deadline = time.monotonic() + 90
        while not _stats_times(sock, time.monotonic() + 0.5):
            assert time.monotonic() < deadline, "worker not ready:\n" + worker.log_text()
        sampling = p.SamplingParams(max_tokens=1)
        frames = [p.encode_gen(f"f{i}", b"ns", list(range(1 + i % 7, 301 + i % 7)), sampling)
                  for i in range(FRAMES)]
        for frame in frames:
            sock.send(frame)
        sent_at = time.monotonic()
        times = _stats_times(sock, sent_at + 3.0)
        assert len(times) >= 10, worker.log_text()
        gaps = [b - a for a, b in zip([sent_at, *times], times, strict=False)]
        assert max(gaps) < MAX_STATS_GAP_S, f"stats stopped for {max(gaps):.2f} s while frames were admitted"
    finally:
        sock.close()
        ctx.term()
