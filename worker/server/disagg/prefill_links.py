"""Disaggregated prefill, decode side: one DEALER link per prefill worker (CurveZMQ under the cluster key),
bounded in number, polled by the serve loop, with a heartbeat while transfers are open and the socket monitor
reporting a dropped connection at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import parse_monitor_message

from worker import protocol as proto

log = logging.getLogger(__name__)

MAX_LINKS = 64
HEARTBEAT_S = 1.0  # a `hello` on links with open transfers: the prefill worker's gateway timeout stays quiet
IDLE_CLOSE_S = 120.0
MAX_REPLY_BYTES = 64 << 20
MAX_REPLIES_PER_DRAIN = 256
LINK_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


@dataclass(slots=True)
class Link:
    endpoint: str
    sock: zmq.Socket
    monitor: zmq.Socket
    last_sent: float = 0.0
    last_used: float = 0.0
    # monotonic time of its latest message (pages, stats: a live prefill worker talks)
    last_heard: float = 0.0
    up: bool = False  # a handshake succeeded since the last drop


class PrefillLinks:
    def __init__(self, ctx: zmq.Context, cluster_key: str | None, worker_id: str) -> None:
        self.ctx = ctx
        self.cluster_key = cluster_key
        self.hello = proto.encode_hello(f"decode:{worker_id}"[:proto.MAX_GATEWAY_ID_LEN])
        self.links: dict[str, Link] = {}
        self.poller: zmq.Poller | None = None  # the serve loop's: links wake it up

    def get(self, endpoint: str, now: float) -> Link | None:
        """The link to `endpoint`, connecting one if needed; None when MAX_LINKS are open."""
        link = self.links.get(endpoint)
        if link is None:
            if len(self.links) >= MAX_LINKS:
                return None
            link = self.links[endpoint] = self._connect(endpoint)
        link.last_used = now
        return link

    def _connect(self, endpoint: str) -> Link:
        sock = self.ctx.socket(zmq.DEALER)
        if self.cluster_key:  # the prefill worker is the CURVE server; we present the cluster's key pair
            secret = self.cluster_key.encode()
            sock.curve_secretkey = secret
            sock.curve_publickey = sock.curve_serverkey = zmq.curve_public(secret)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        sock.setsockopt(zmq.SNDHWM, 1_000)
        monitor = sock.get_monitor_socket(LINK_EVENTS)
        sock.connect(endpoint)
        if self.poller is not None:
            self.poller.register(sock, zmq.POLLIN)
            self.poller.register(monitor, zmq.POLLIN)
        return Link(endpoint, sock, monitor)

    def send(self, link: Link, payload: bytes, now: float) -> bool:
        try:
            link.sock.send(payload, zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        link.last_sent = now
        return True

    def replies(self) -> Iterator[tuple[Link, list[zmq.Frame]]]:
        """Messages waiting on every link (bounded per call), without copying their page rows."""
        for link in list(self.links.values()):
            for _ in range(MAX_REPLIES_PER_DRAIN):
                try:
                    parts = link.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                link.last_heard = time.monotonic()
                yield link, parts

    def dropped(self) -> list[Link]:
        """Links whose connection dropped since the last call (handshakes mark them up again)."""
        gone = []
        for link in self.links.values():
            while True:
                try:
                    event = parse_monitor_message(link.monitor.recv_multipart(zmq.NOBLOCK))["event"]
                except zmq.Again:
                    break
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    link.up = True
                elif event == zmq.EVENT_DISCONNECTED and link.up:
                    link.up = False
                    gone.append(link)
        return gone

    def housekeeping(self, now: float, busy: set[str]) -> None:
        """Heartbeat links with open transfers; close links idle for IDLE_CLOSE_S."""
        for endpoint, link in list(self.links.items()):
            if endpoint in busy:
                if now - link.last_sent >= HEARTBEAT_S:
                    self.send(link, self.hello, now)
            elif now - link.last_used >= IDLE_CLOSE_S:
                self._close(self.links.pop(endpoint))

    def _close(self, link: Link) -> None:
        if self.poller is not None:
            self.poller.unregister(link.sock)
            self.poller.unregister(link.monitor)
        link.sock.disable_monitor()
        link.monitor.close(linger=0)
        link.sock.close(linger=0)

    def close(self) -> None:
        for link in self.links.values():
            self._close(link)
        self.links.clear()
