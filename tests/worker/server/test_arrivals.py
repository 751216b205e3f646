"""An idle worker's loop gathers a burst of frames into one step; a lone frame waits one quiet period."""

from __future__ import annotations

import threading
import time

import zmq

from worker.server.process import arrivals


def _pair() -> tuple[zmq.Context, zmq.Socket, zmq.Socket, zmq.Poller]:
    ctx = zmq.Context()
    server, client = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client.connect(f"tcp://127.0.0.1:{port}")
    poller = zmq.Poller()
    poller.register(server, zmq.POLLIN)
    return ctx, server, client, poller


def _drainer(sock: zmq.Socket, got: list[bytes]):
    def drain() -> None:
        while True:
            try:
                got.append(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
    return drain


def test_a_burst_a_millisecond_apart_is_gathered_and_a_lone_frame_waits_one_quiet_period(monkeypatch):
    monkeypatch.setattr(arrivals, "QUIET_MS", 50)  # wide enough for a loaded CI machine's scheduling
    monkeypatch.setattr(arrivals, "GATHER_MS", 2000)
    ctx, server, client, poller = _pair()
    try:
        got: list[bytes] = []

        def burst() -> None:
            for i in range(6):
                client.send(b"%d" % i)
                time.sleep(0.001)

        sender = threading.Thread(target=burst)
        sender.start()
        assert poller.poll(1000)
        _drainer(server, got)()  # the first arrival, as the loop drains it
        arrivals.gather(poller, _drainer(server, got))
        sender.join(5)
        assert got == [b"%d" % i for i in range(6)]

        t0 = time.monotonic()
        arrivals.gather(poller, _drainer(server, got))  # nothing comes: one quiet period
        assert time.monotonic() - t0 < (arrivals.QUIET_MS + 200) / 1000
    finally:
        client.close(0)
        server.close(0)
        ctx.term()


def test_the_gathering_ends_by_its_deadline_under_a_steady_stream():
    ctx, server, client, poller = _pair()
    stop = threading.Event()

    def stream() -> None:
        while not stop.is_set():
            client.send(b"x")
            time.sleep(0.0005)

    try:
        got: list[bytes] = []
        sender = threading.Thread(target=stream)
        sender.start()
        t0 = time.monotonic()
        arrivals.gather(poller, _drainer(server, got))
        elapsed = time.monotonic() - t0
        stop.set()
        sender.join(5)
        assert got and elapsed < (arrivals.GATHER_MS + 30) / 1000
    finally:
        client.close(0)
        server.close(0)
        ctx.term()
