"""HTTP client side of the fault tests: one streaming completion, classified, with its tokens counted.

`stream_completion` posts a streaming `/v1/completions` request with `logprobs` on, so every SSE chunk
lists the tokens it carries and the client knows exactly how many completion tokens the gateway
charged, even for a stream that ends with an error event. The `StreamResult` says how it ended:
`completed` (`[DONE]` after a finish reason), `refused` (an HTTP error status before any event),
`error_event` (a final SSE `error` event) or `cut` (the connection dropped: never acceptable here).
It also keeps the time to the first token and the response headers. `p99` is the latency statistic.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx


@dataclass(slots=True)
class StreamResult:
    status: int
    outcome: str  # completed | refused | error_event | cut
    tokens: int = 0  # completion tokens received
    usage: dict | None = None
    error: dict | None = None  # OpenAI error body fields of a refusal or error event
    ttft_s: float | None = None
    elapsed_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def code(self) -> str | None:
        return None if self.error is None else self.error.get("code")


def completion_body(prompt: Sequence[int] | str, max_tokens: int, **extra: object) -> dict:
    return {"model": "default", "prompt": list(prompt) if not isinstance(prompt, str) else prompt,
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True, "logprobs": 1,
            "stream_options": {"include_usage": True}, **extra}


async def stream_completion(http: httpx.AsyncClient, base_url: str, key: str, body: dict,
                            started: asyncio.Semaphore | None = None) -> StreamResult:
    """Run one streaming request to its end; `started` is released at its first token."""
    start = time.perf_counter()
    headers = {"authorization": f"Bearer {key}"}
    async with http.stream("POST", base_url + "/v1/completions", json=body, headers=headers) as resp:
        result = StreamResult(resp.status_code, "cut", headers=dict(resp.headers))
        if resp.status_code != 200:
            await resp.aread()
            result.outcome = "refused"
            result.error = resp.json().get("error")
            result.elapsed_s = time.perf_counter() - start
            return result
        try:
            await _read_events(resp, result, start, started)
        except httpx.HTTPError:
            result.outcome = "cut"
    result.elapsed_s = time.perf_counter() - start
    return result


async def _read_events(resp: httpx.Response, result: StreamResult, start: float,
                       started: asyncio.Semaphore | None) -> None:
    finished = False
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            result.outcome = "completed" if finished else "cut"
            return
        event = json.loads(line[6:])
        if "error" in event:
            result.outcome, result.error = "error_event", event["error"]
            return
        if event.get("usage"):
            result.usage = event["usage"]
        for choice in event.get("choices") or []:
            n = len((choice.get("logprobs") or {}).get("tokens") or [])
            if n and result.ttft_s is None:
                result.ttft_s = time.perf_counter() - start
                if started is not None:
                    started.release()
            result.tokens += n
            finished = finished or choice.get("finish_reason") is not None


def p99(values: Sequence[float]) -> float:
    """The nearest-rank 99th percentile (the maximum for fewer than 100 values)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def metric(base_url: str, name: str, labels: str = "") -> float:
    """One sample of a gateway's /metrics, e.g. `metric(url, "switchyard_shed_total", 'reason="draining"')`;
    0 when the series does not exist yet."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series == wanted:
            return float(value)
    return 0.0
