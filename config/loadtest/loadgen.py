"""Async streaming load generator for any OpenAI-compatible chat server.

Workloads come from a seed and an in-module word list (nothing is downloaded); each request yields one
`RequestRecord`.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

WORKLOADS = ("single", "prefix", "mixed")

# A fixed vocabulary: prompts are reproducible from the seed alone.
WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have "
    "an they you were her she there been one all we their has would when if so no will can more other "
    "about time out up some into them could then than like only its new two may first any these people "
    "after year work through over also where most way many before must back years state well such because "
    "water world city river market garden engine signal network server cluster memory cache token request "
    "budget tenant window queue batch paper music color light stone forest ocean mountain valley bridge "
    "tower castle island harbor village winter summer autumn spring morning evening history science "
    "language number pattern answer question problem method system process theory measure balance energy "
    "motion orbit planet comet galaxy crystal metal silver copper iron glass clock compass map journey "
    "travel letter story poem song dance painting bread apple orange lemon coffee tea honey salt pepper "
    "simple quiet bright careful ancient modern rapid gentle strong narrow wide deep early late"
).split()

QUESTION_STARTS = (
    "Explain briefly", "Summarize in one sentence", "Describe", "Give one fact about",
    "Write a short note on", "List two ideas about", "What is", "Tell me about",
)


@dataclass(slots=True)
class RequestSpec:
    """One request of a workload: chat messages and the completion budget."""

    index: int
    messages: list[dict[str, str]]
    max_tokens: int


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request; times are seconds (perf_counter based)."""

    index: int
    start: float  # since the start of the run
    status: int = 0  # HTTP status; 0 when no response arrived
    error: str | None = None  # None on success, else the key counted in `errors`
    ttft: float | None = None  # request start -> first content chunk
    e2e: float | None = None  # request start -> end of stream
    chunk_times: list[float] = field(default_factory=list)  # content chunk arrivals since request start
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    usage_reported: bool = False
    detail: str | None = None  # error message from the server's error body, if any (truncated)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(slots=True)
class LoadConfig:
    """Everything `run_load` needs besides the workload."""

    url: str  # server base URL, with or without a trailing /v1
    key: str
    model: str | None = None  # None: first id from GET /v1/models
    concurrency: int = 8
    request_timeout: float = 120.0
    progress: bool = True
    temperature: float = 0.0


def _sentence(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _question(rng: random.Random, n_words: int) -> str:
    return f"{rng.choice(QUESTION_STARTS)} {_sentence(rng, n_words)}."


DEFAULT_PROMPT_WORDS = {"single": 6, "prefix": 300, "mixed": 400}


def build_workload(
    name: str, n: int, seed: int = 0, max_tokens: int = 64,
    prompt_words: int | None = None, prefix_count: int = 4,
) -> list[RequestSpec]:
    """The `n` requests of workload `name`, identical for the same arguments.

    single: one short prompt repeated. prefix: `prefix_count` long shared system
    prompts of `prompt_words` words (default 300), each request a distinct short
    question under one of them. mixed: prompt lengths log-uniform in
    [4, `prompt_words`] words (default 400) and output budgets uniform in
    [max(1, max_tokens // 8), max_tokens].
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: choose one of {', '.join(WORKLOADS)}")
    if n < 1 or max_tokens < 1 or prefix_count < 1:
        raise ValueError("n, max_tokens and prefix_count must be positive")
    if prompt_words is not None and prompt_words < 4:
        raise ValueError("prompt_words must be at least 4")
    words_cap = prompt_words or DEFAULT_PROMPT_WORDS[name]
    rng = random.Random(seed)
    if name == "single":
        messages = [{"role": "user", "content": _question(rng, words_cap)}]
        return [RequestSpec(i, [dict(m) for m in messages], max_tokens) for i in range(n)]
    if name == "prefix":
        systems = [f"You are assistant number {k}. " + _sentence(rng, words_cap) for k in range(prefix_count)]
        return [
            RequestSpec(i, [{"role": "system", "content": systems[rng.randrange(prefix_count)]},
                            {"role": "user", "content": f"Question {i}: {_question(rng, 10)}"}], max_tokens)
            for i in range(n)
        ]
    specs = []
    low = max(1, max_tokens // 8)
    for i in range(n):
        words = int(round(4 * (words_cap / 4) ** rng.random()))  # log-uniform in [4, words_cap]
        specs.append(RequestSpec(i, [{"role": "user", "content": _question(rng, words)}],
                                 rng.randint(low, max_tokens)))
    return specs


def api_base(url: str) -> str:
    """`http://h:p`, `http://h:p/` or `http://h:p/v1` -> `http://h:p/v1`."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url must start with http:// or https://, got {url!r}")
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


async def discover_model(client: httpx.AsyncClient, base: str, timeout: float) -> str:
    """The first model id the server lists at GET /v1/models."""
    try:
        resp = await client.get(f"{base}/models", timeout=timeout)
        resp.raise_for_status()
        data = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        raise RuntimeError(f"cannot list models at {base}/models ({exc}); pass --model") from None
    if not data:
        raise RuntimeError(f"{base}/models lists no models; pass --model")
    return str(data[0]["id"])


def _apply_usage(record: RequestRecord, usage: dict[str, Any]) -> None:
    record.usage_reported = True
    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    record.completion_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details")
    record.cached_tokens = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0


def _error_message(body: bytes) -> str:
    """The `error.message` (and code) of an OpenAI error body, else the body's start."""
    try:
        err = json.loads(body)["error"]
        text = f"{err.get('code') or err.get('type') or ''}: {err.get('message', '')}"
    except (ValueError, KeyError, TypeError, AttributeError):
        text = body.decode("utf-8", "replace")
    return text[:200]


def _handle_event(record: RequestRecord, payload: str, t0: float) -> bool:
    """Apply one SSE `data:` payload; True when the stream is finished."""
    if payload == "[DONE]":
        return True
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        record.error = "bad_sse"
        return True
    if not isinstance(obj, dict):
        record.error = "bad_sse"
        return True
    if obj.get("error") is not None:
        record.error = "stream_error"
        record.detail = _error_message(payload.encode())
        return True
    for choice in obj.get("choices") or ():
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if isinstance(delta, dict) and delta.get("content"):
            now = time.perf_counter() - t0
            if record.ttft is None:
                record.ttft = now
            record.chunk_times.append(now)
            break
    if isinstance(obj.get("usage"), dict):
        _apply_usage(record, obj["usage"])
    return False


async def _stream_one(
    client: httpx.AsyncClient, endpoint: str, body: dict[str, Any], record: RequestRecord, t0: float,
) -> None:
    async with client.stream("POST", endpoint, json=body) as resp:
        record.status = resp.status_code
        if resp.status_code != 200:
            record.error = str(resp.status_code)
            record.detail = _error_message(await resp.aread())
            return
        done = False
        async for line in resp.aiter_lines():
            if line.startswith("data:") and _handle_event(record, line[5:].strip(), t0):
                done = True
                break
        if not done and record.error is None:
            record.error = "truncated"  # the connection closed without [DONE]


async def send_request(
    client: httpx.AsyncClient, endpoint: str, model: str, spec: RequestSpec,
    run_start: float, timeout: float, temperature: float = 0.0,
) -> RequestRecord:
    """Send one streaming chat request and record its timings; never raises for request failures."""
    t0 = time.perf_counter()
    record = RequestRecord(index=spec.index, start=t0 - run_start)
    body = {
        "model": model, "messages": spec.messages, "max_tokens": spec.max_tokens,
        "temperature": temperature, "stream": True, "stream_options": {"include_usage": True},
    }
    try:
        async with asyncio.timeout(timeout):
            await _stream_one(client, endpoint, body, record, t0)
    except TimeoutError:
        record.error = "timeout"
    except httpx.HTTPError as exc:
        record.error = "timeout" if isinstance(exc, httpx.TimeoutException) else "transport"
    record.e2e = time.perf_counter() - t0
    if record.ok and not record.usage_reported:
        record.completion_tokens = len(record.chunk_times)
    # A success with no content chunk (e.g. only an EOS) has no TTFT; it counts as completed.
    return record


def _progress_bar(total: int, enabled: bool) -> tqdm:
    return tqdm(total=total, file=sys.stderr, disable=not enabled, unit="req", dynamic_ncols=True)


async def run_load(
    config: LoadConfig, specs: list[RequestSpec], on_done: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float, str]:
    """Run all `specs` with bounded concurrency; returns (records by index, duration_s, model)."""
    if config.concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    if config.request_timeout <= 0:
        raise ValueError("request timeout must be positive")
    base = api_base(config.url)
    limits = httpx.Limits(max_connections=config.concurrency, max_keepalive_connections=config.concurrency)
    headers = {"Authorization": f"Bearer {config.key}"}
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=config.request_timeout) as client:
        model = config.model or await discover_model(client, base, config.request_timeout)
        endpoint = f"{base}/chat/completions"
        pending = iter(specs)
        records: list[RequestRecord] = []
        bar = _progress_bar(len(specs), config.progress)
        run_start = time.perf_counter()

        async def lane() -> None:
            for spec in pending:  # the shared iterator hands each spec to exactly one lane
                record = await send_request(client, endpoint, model, spec, run_start,
                                            config.request_timeout, config.temperature)
                records.append(record)
                bar.update(1)
                if on_done is not None:
                    on_done(record)

        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(min(config.concurrency, len(specs))):
                    group.create_task(lane())
        finally:
            bar.close()
        duration = time.perf_counter() - run_start
    records.sort(key=lambda r: r.index)
    return records, duration, model
