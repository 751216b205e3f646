"""The gateway keeps an idle keep-alive connection open past clients' pool expiry (httpx: 5 s), so a client
that reuses it never races the server's close (uvicorn's default of 5 s lost requests to that race)."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

from tests.gateway_stack import GatewayStack

IDLE_S = 6.0  # past httpx's and uvicorn's 5 s defaults


def _get_health(sock: socket.socket) -> bytes:
    """One GET /health on `sock`: the response (headers, content-length body), or what came before a close."""
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    got = b""
    while b"\r\n\r\n" not in got or len(got) < _response_length(got):
        chunk = sock.recv(4096)
        if not chunk:
            return got
        got += chunk
    return got


def _response_length(got: bytes) -> int:
    head, _, _ = got.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return len(head) + 4 + length


def test_idle_keep_alive_connection_is_still_served_after_six_seconds(stack: GatewayStack) -> None:
    url = urlsplit(stack.base_url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        assert _get_health(sock).startswith(b"HTTP/1.1 200")
        time.sleep(IDLE_S)
        assert _get_health(sock).startswith(b"HTTP/1.1 200"), \
            "the gateway closed an idle keep-alive connection"
