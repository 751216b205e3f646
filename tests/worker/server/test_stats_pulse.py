"""StatsPulse keeps stats frames flowing on a real ROUTER socket while the loop is busy, from the loop's
own next stats time on, and stops when disarmed (so the loop can use the socket alone again)."""

from __future__ import annotations

import time

import zmq

from worker.server.process.stats_pulse import StatsPulse


def _pair(ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket, bytes]:
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"gw-1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(b"hello")
    assert router.poll(5000), "router heard nothing"
    ident, _ = router.recv_multipart()
    return router, dealer, ident


def _drain(sock: zmq.Socket, wait_ms: int) -> list[bytes]:
    frames = []
    while sock.poll(wait_ms):
        frames.append(sock.recv())
    return frames


def test_pulse_sends_while_armed_and_stops_when_disarmed() -> None:
    ctx = zmq.Context()
    router, dealer, ident = _pair(ctx)
    pulse = StatsPulse(router, interval_s=0.05)
    try:
        pulse.arm(b"stats-frame", [ident])
        time.sleep(0.4)  # a "long engine step"
        pulse.disarm()
        frames = _drain(dealer, 200)
        assert frames and set(frames) == {b"stats-frame"}
        assert 3 <= len(frames) <= 9, len(frames)
        assert _drain(dealer, 200) == []  # nothing after disarm
        pulse.arm(b"quick", [ident])
        pulse.disarm()  # a step shorter than one interval sends nothing
        assert _drain(dealer, 150) == []
    finally:
        pulse.close()
        dealer.close(0)
        router.close(0)
        ctx.term()


def test_the_first_pulse_comes_when_the_loops_stats_are_due_not_an_interval_after_arming() -> None:
    ctx = zmq.Context()
    router, dealer, ident = _pair(ctx)
    pulse = StatsPulse(router, interval_s=0.5)
    try:
        armed = time.monotonic()
        pulse.arm(b"due-soon", [ident], due_at=armed + 0.05)  # the loop's stats were due 50 ms into the step
        assert dealer.poll(400), "no pulse before the loop's stats time plus 350 ms"
        assert dealer.recv() == b"due-soon"
        assert time.monotonic() - armed >= 0.045  # not before it was due
        pulse.arm(b"re-armed", [ident], due_at=time.monotonic() + 0.05)  # the next step: a new due time
        assert dealer.poll(400) and dealer.recv() == b"re-armed"
        pulse.disarm()
    finally:
        pulse.close()
        dealer.close(0)
        router.close(0)
        ctx.term()
