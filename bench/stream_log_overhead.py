"""Benchmark: the gateway's cost of resumable streams (event ids, the batched Redis event log, the pump task).

N concurrent streams of M chat-sized events each go through the gateway's SSE framing with resumability off
(the body as is) and on (`gateway.streams.ResumableStream` over a real Redis), in alternating rounds of one
run. Prints one JSON line: events per second of each mode (best round), the microseconds each event costs
more with it on, and on/off (target >= 0.95). Each event is framed as the gateway frames a chat chunk, but
nothing is sent over HTTP and no worker is involved, so on/off here is a lower bound on the end-to-end ratio.
With `--http` the same comparison runs end to end instead: one worker, two gateways (`stream_resume` on and
off), `--streams` concurrent streaming completions of `--events` tokens each, alternating between the
gateways; it prints completion tokens per second of each (best round) and on/off.
Run: `python -m bench.stream_log_overhead [--http] [--streams 64 --events 300 --rounds 3]` (redis-server).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import time

from bench.machine import cpu_model
from config.local_stack.launcher import free_port, wait_for_port

TARGET = 0.95


async def _source(events: int):
    """The gateway's own framing of each token (`ResponseShape.chunk`, `sse.event`), one token at a time."""
    from gateway.openai.bodies import ResponseShape
    from gateway.web.sse import event

    shape = ResponseShape("chatcmpl-" + "0" * 32, 1764374400, "default", True)
    for i in range(events):
        await asyncio.sleep(0)
        yield event(shape.chunk(" word", None, None, first=i == 0, text_offset=5 * i))


async def _noop() -> None:
    return None


async def _one(logs, i: int, events: int) -> int:
    from gateway.streams.resumable import ResumableStream

    body = _source(events)
    if logs is not None:
        stream = ResumableStream(logs, "bench", f"chatcmpl-{i}", body, _noop, id_prefix=f"chatcmpl-{i}:")
        body = stream.body()
    n = 0
    async for data in body:
        n += data.count(b"\n\n")
    if logs is not None:
        await stream.close()
    return n


async def _round(logs, streams: int, events: int) -> float:
    start = time.perf_counter()
    counts = await asyncio.gather(*(_one(logs, i, events) for i in range(streams)))
    elapsed = time.perf_counter() - start
    assert sum(counts) == streams * events
    return sum(counts) / elapsed


async def run(url: str, streams: int, events: int, rounds: int) -> dict:
    from gateway.streams.event_log import EventLogs
    from tenancy.redis_client import async_client

    redis = async_client(url)
    logs = EventLogs(redis)
    best = {"off": 0.0, "on": 0.0}
    try:
        for _ in range(rounds):
            best["off"] = max(best["off"], await _round(None, streams, events))
            best["on"] = max(best["on"], await _round(logs, streams, events))
        await logs.close()
        logged = await redis.xlen("{t:bench}:sse:chatcmpl-0")
    finally:
        await redis.aclose()
    ratio = best["on"] / best["off"]
    return {"bench": "stream_log_overhead", "cpu": cpu_model(), "streams": streams, "events": events,
            "events_per_s_off": round(best["off"]), "events_per_s_on": round(best["on"]),
            "added_us_per_event": round(1e6 / best["on"] - 1e6 / best["off"], 2),
            "on_over_off": round(ratio, 3), "logged_per_stream": logged, "met": ratio >= TARGET}


async def _http_round(base: str, key: str, streams: int, events: int) -> float:
    import httpx

    body = {"model": "default", "prompt": [100 + i for i in range(8)], "max_tokens": events,
            "ignore_eos": True, "temperature": 0, "stream": True}

    async def one(http: httpx.AsyncClient) -> int:
        n = 0
        async with http.stream("POST", base + "/v1/completions", json=body,
                               headers={"authorization": f"Bearer {key}"}) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                n += line.startswith("data: {")
        return n

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=streams)) as http:
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(http) for _ in range(streams)))
        return sum(counts) / (time.perf_counter() - start)


def run_http(url: str, args: argparse.Namespace) -> dict:
    """Worker and gateways as processes; the best round of each gateway."""
    import tempfile
    from pathlib import Path

    from config.local_stack.launcher import GatewayProc, WorkerProc
    from tenancy.tenant_admin import tenant_with_new_key

    logs = Path(tempfile.mkdtemp(prefix="sy-stream-bench-"))
    worker = WorkerProc(logs, model=args.model, extra=["--no-prefix-cache"], threads=args.threads)
    gateways = {}
    try:
        for mode, on in (("on", "true"), ("off", "false")):
            toml = logs / f"gateway-{mode}.toml"
            toml.write_text(f"[gateway]\nstream_resume = {on}\nworkers = [\"{worker.endpoint}\"]\n")
            gateways[mode] = GatewayProc.spawn(logs, ["--config", str(toml), "--redis-url", url])
        deadline = time.monotonic() + 240
        while not all(g.ready() for g in gateways.values()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"gateways not ready; logs in {logs}")
            time.sleep(0.5)
        key = tenant_with_new_key(url, "bench", tpm=0, rpm=0, max_concurrent=0)
        best = {"off": 0.0, "on": 0.0}
        asyncio.run(_http_round(gateways["off"].base_url, key, args.streams, 8))  # warm-up
        for _ in range(args.rounds):
            for mode in ("off", "on"):
                rate = asyncio.run(_http_round(gateways[mode].base_url, key, args.streams, args.events))
                best[mode] = max(best[mode], rate)
    finally:
        for g in gateways.values():
            g.stop()
        worker.stop()
    ratio = best["on"] / best["off"]
    return {"bench": "stream_log_overhead_http", "cpu": cpu_model(), "model": args.model,
            "streams": args.streams, "tokens": args.events, "tokens_per_s_off": round(best["off"], 1),
            "tokens_per_s_on": round(best["on"], 1), "on_over_off": round(ratio, 3), "met": ratio >= TARGET}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--events", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--http", action="store_true", help="end to end: a worker and two gateways as processes")
    ap.add_argument("--model", default="tiny-random", help="--http: the worker's model")
    ap.add_argument("--threads", type=int, default=1, help="--http: the worker's threads")
    ap.add_argument("--json", action="store_true", help="(the output is always one JSON line)")
    args = ap.parse_args()
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not installed")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port)
        url = f"redis://127.0.0.1:{port}/0"
        out = run_http(url, args) if args.http else \
            asyncio.run(run(url, args.streams, args.events, args.rounds))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    print(json.dumps(out))
    return 0 if out["met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
