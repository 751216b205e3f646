"""Posts a 4 MB token-id body every `every` seconds until terminated, for the hardening fault test.

Prints "ready" once the body is built, then one JSON line per answer: status, error param, seconds, bytes.
"""

from __future__ import annotations

import json
import signal
import sys
import time

import httpx

# 530,000 token ids: just over 4,000,000 bytes, under the gateway's 4 MiB body limit
BODY = json.dumps({"model": "default", "prompt": list(range(100, 100 + 530_000)), "max_tokens": 4}).encode()


def main(url: str, key: str, every: float) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    with httpx.Client(timeout=30) as http:
        while True:
            start = time.perf_counter()
            resp = http.post(url + "/v1/completions", content=BODY, headers={
                "authorization": f"Bearer {key}", "content-type": "application/json"})
            print(json.dumps({"status": resp.status_code, "param": resp.json()["error"]["param"],
                              "seconds": time.perf_counter() - start, "bytes": len(BODY)}), flush=True)
            time.sleep(every)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
