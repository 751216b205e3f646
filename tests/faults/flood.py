"""An unknown-API-key flood for the hardening fault test, run as its own process: raw HTTP/1.1 keep-alive
requests, each with a new well-formed key, at up to `rate` requests/s for `seconds`.

Prints one JSON line: requests sent, seconds taken and the count of each response status.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections import Counter

BODY = json.dumps({"model": "default", "prompt": "hi", "max_tokens": 1}).encode()


def _request(port: int, key: str) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(BODY)}\r\n\r\n").encode() + BODY


async def _connection(port: int, until: float, interval: float, statuses: Counter) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    next_at = time.monotonic()
    try:
        while time.monotonic() < until:
            key = "sy-" + os.urandom(30).hex()[:40]
            writer.write(_request(port, key))
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            statuses[int(lines[0].split()[1])] += 1
            length = next((int(x.split(":")[1]) for x in lines if x.lower().startswith("content-length:")), 0)
            await reader.readexactly(length)
            next_at += interval
            delay = next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
    finally:
        writer.close()


async def main(port: int, seconds: float, rate: float, connections: int) -> None:
    statuses: Counter = Counter()
    start = time.monotonic()
    await asyncio.gather(*(_connection(port, start + seconds, connections / rate, statuses)
                           for _ in range(connections)))
    elapsed = time.monotonic() - start
    print(json.dumps({"sent": sum(statuses.values()), "seconds": elapsed,
                      "statuses": {str(k): v for k, v in statuses.items()}}), flush=True)


if __name__ == "__main__":
    port, seconds, rate, connections = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    asyncio.run(main(port, seconds, rate, connections))
