"""An unknown-API-key flood (bench/flood.py and the hardening fault test), run as its own process: HTTP/1.1
keep-alive connections, each pipelining up to `window` requests that each carry a new well-formed key, at up
to `rate` requests/s in total for `seconds` (rate 0: as fast as the gateway answers). Window 0: a new
connection per request instead (`connection: close`, one request in flight per connection), the shape of a
botnet's flood.

Prints one JSON line: requests sent and answered, seconds taken, the count of each response status and the
generator's own CPU seconds. A load generator (for bench/flood.py): no targets of its own.
"""

from __future__ import annotations

import asyncio
import binascii
import contextlib
import json
import os
import sys
import time
from collections import Counter

BODY = json.dumps({"model": "default", "prompt": "hi", "max_tokens": 1}).encode()
KEY_BYTES = 20  # 40 hex characters after "sy-", the shape of a real key


class _Pipelined(asyncio.Protocol):
    """One connection: writes requests in batches, parses the answers as they come (status + length only)."""

    def __init__(self, port: int, statuses: Counter) -> None:
        self.head = (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
                     f"content-type: application/json\r\ncontent-length: {len(BODY)}\r\n"
                     "authorization: Bearer sy-").encode()
        self.tail = b"\r\n\r\n" + BODY
        self.statuses = statuses
        self.buf = bytearray()
        self.outstanding = 0
        self.answered = asyncio.Event()
        self.closed = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport
        self.transport = transport  # type: ignore[assignment]

    def send(self, n: int) -> None:
        assert self.transport is not None
        keys = binascii.hexlify(os.urandom(KEY_BYTES * n))
        self.transport.write(b"".join(self.head + keys[i:i + 2 * KEY_BYTES] + self.tail
                                      for i in range(0, 2 * KEY_BYTES * n, 2 * KEY_BYTES)))
        self.outstanding += n

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end]).lower() + b"\r\n"
            at = head.find(b"content-length:")
            length = int(head[at + 15:head.find(b"\r\n", at)]) if at >= 0 else 0
            if len(buf) < end + 4 + length:
                return
            self.statuses[int(head[9:12])] += 1
            del buf[:end + 4 + length]
            self.outstanding -= 1
            self.answered.set()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        self.answered.set()


async def _connection(port: int, until: float, rate: float, window: int, statuses: Counter) -> int:
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(lambda: _Pipelined(port, statuses), "127.0.0.1", port)
    sent, start = 0, time.monotonic()
    try:
        while (now := time.monotonic()) < until and not conn.closed.done():
            due = window if rate <= 0 else min(window, int((now - start) * rate) - sent)
            room = window - conn.outstanding
            n = min(due, room)
            if n > 0:
                conn.send(n)
                sent += n
            conn.answered.clear()
            if room <= 0 or rate <= 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(conn.answered.wait(), max(0.01, until - time.monotonic()))
            else:
                await asyncio.sleep(min(0.01, max(0.0, until - time.monotonic())))
        async with asyncio.timeout(10):  # the answers still due
            while conn.outstanding > 0 and not conn.closed.done():
                conn.answered.clear()
                await conn.answered.wait()
    except TimeoutError:
        pass
    finally:
        if conn.transport is not None:
            conn.transport.close()
    return sent


async def _per_request(port: int, until: float, rate: float, statuses: Counter) -> int:
    """One request per TCP connection, each waited for, at up to `rate` per second (0: back to back)."""
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nconnection: close\r\n"
            f"content-type: application/json\r\ncontent-length: {len(BODY)}\r\n"
            "authorization: Bearer sy-").encode()
    sent, start = 0, time.monotonic()
    while (now := time.monotonic()) < until:
        if rate > 0 and sent >= (now - start) * rate:
            await asyncio.sleep(0.005)
            continue
        try:
            async with asyncio.timeout(max(0.1, until - now + 5)):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(head + binascii.hexlify(os.urandom(KEY_BYTES)) + b"\r\n\r\n" + BODY)
                sent += 1
                status = await reader.readline()
                statuses[int(status[9:12]) if status[:5] == b"HTTP/" else 0] += 1
                writer.close()
        except (OSError, TimeoutError):
            statuses[0] += 1
    return sent


async def main(port: int, seconds: float, rate: float, connections: int, window: int) -> None:
    statuses: Counter = Counter()
    start = time.monotonic()
    if window == 0:
        jobs = [_per_request(port, start + seconds, rate / connections, statuses) for _ in range(connections)]
    else:
        jobs = [_connection(port, start + seconds, rate / connections, window, statuses)
                for _ in range(connections)]
    sent = await asyncio.gather(*jobs)
    elapsed = time.monotonic() - start
    print(json.dumps({"sent": sum(sent), "answered": sum(statuses.values()), "seconds": round(elapsed, 2),
                      "statuses": {str(k): v for k, v in statuses.items()},
                      "cpu_s": round(time.process_time(), 2)}), flush=True)


if __name__ == "__main__":
    port, seconds, rate, connections = (int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]),
                                        int(sys.argv[4]))
    window = int(sys.argv[5]) if len(sys.argv) > 5 else 16
    import uvloop

    uvloop.run(main(port, seconds, rate, connections, window))
