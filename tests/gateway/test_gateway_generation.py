"""Generation: worker token chunks -> text deltas, with the real tokenizer and real token ids.

The chunks are scripted (as the worker would send them: one token each, the last
one with a finish reason), so that multi-byte characters split across tokens,
stop strings and usage can be checked exactly.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import pytest

from admission import AdmissionTicket, Reservation, ReserveResult
from common.priorities import Priority
from gateway.flow.generation import Generation, Prepared
from gateway.flow.served_model import ServedModel
from gateway.openai.bodies import ResponseShape, Usage
from gateway.openai.schemas import parse_completion
from gateway.web.api_errors import ApiError
from router import WorkerError
from router.links.client import LinkError
from tenancy.schema import Tenant
from worker.protocol import ErrorCode, OutItem

TEXT = "日本語のテスト 🎉👩‍👩‍👧 — done"


@pytest.fixture(scope="module")
def model() -> ServedModel:
    return ServedModel.load("default")


class Script:
    def __init__(self, tokens: list[int], finish: str = "length") -> None:
        self.tokens, self.finish, self.closed = tokens, finish, False

    async def stream(self) -> AsyncIterator[OutItem]:
        try:
            for i, t in enumerate(self.tokens):
                last = i == len(self.tokens) - 1
                yield OutItem("r", [t], self.finish if last else None, 3, [-0.5])
        finally:
            self.closed = True


def make(model: ServedModel, script: Script, **body) -> Generation:
    req = parse_completion({"model": "default", "prompt": "x", **body})
    prepared = Prepared("req-1", req, Tenant(name="t"), [1, 2], None, 100, Priority.INTERACTIVE, b"ns",
                        ResponseShape("cmpl-1", 0, "default", False))
    stack = AsyncExitStack()
    chunks = script.stream()
    stack.push_async_callback(chunks.aclose)
    return Generation(model, prepared, chunks, stack, Usage(prompt_tokens=2), {}, 10.0)


async def test_split_multibyte_characters_never_yield_replacement(model):
    tokens = model.tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(tokens) > len(TEXT.split())  # characters really are split over several tokens
    gen = make(model, Script(tokens))
    deltas = []
    while (d := await gen.next()) is not None:
        deltas.append(d)
    await gen.close()
    assert all("\ufffd" not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) == TEXT
    assert deltas[-1].finish_reason == "length"
    assert gen.usage.completion_tokens == len(tokens) and gen.usage.cached_tokens == 3


async def test_stop_string_ends_the_stream_and_closes_the_worker_stream(model):
    tokens = model.tokenizer.encode(TEXT, add_special_tokens=False)
    script = Script(tokens)
    gen = make(model, script, stop=["テス"])
    text, logprobs = await gen.collect()
    assert text == "日本語の"
    assert gen.finish_reason == "stop"
    assert gen.usage.completion_tokens < len(tokens)
    assert logprobs is None
    await gen.close()
    assert script.closed  # leaving the worker stream early is what sends `abort`


async def test_logprobs_follow_tokens(model):
    tokens = model.tokenizer.encode("Hello world", add_special_tokens=False)
    gen = make(model, Script(tokens, finish="stop"), logprobs=0)
    text, logprobs = await gen.collect()
    await gen.close()
    assert text == "Hello world" and gen.finish_reason == "stop"
    assert [lp.logprob for lp in logprobs] == [-0.5] * len(tokens)
    assert "".join(lp.token for lp in logprobs) == text


class Failing:
    """A worker stream that fails (or hangs) before or after some tokens."""

    def __init__(self, tokens: list[int], error: Exception | None) -> None:
        self.tokens, self.error, self.closed = tokens, error, False

    async def stream(self) -> AsyncIterator[OutItem]:
        try:
            for t in self.tokens:
                yield OutItem("r", [t], None, 0, [-0.5])
            if self.error is None:
                await asyncio.sleep(3600)
            raise self.error
        finally:
            self.closed = True


def with_ticket(gen: Generation) -> AdmissionTicket:
    result = ReserveResult(0, None, *([0] * 11))
    gen.ticket = AdmissionTicket(Reservation(Tenant(name="t"), "lease-1", 2, 100, result), None)
    return gen.ticket


async def test_first_token_timeout_is_refunded_like_any_failure(model):
    gen = make(model, Failing([], None))  # type: ignore[arg-type]
    gen.first_token_timeout_s = 0.05
    ticket = with_ticket(gen)
    with pytest.raises(ApiError) as exc:
        await gen.next()
    await gen.close()
    assert exc.value.status == 503 and exc.value.code == "worker_unavailable"
    assert ticket.reservation.served is False and ticket.reservation.refund_tokens == 102


async def test_worker_addresses_never_reach_the_client(model):
    cases = [WorkerError(LinkError.WORKER_LOST, "no stats from tcp://10.1.2.3:5555 for 1.0s", True),
             WorkerError(LinkError.INCOMPATIBLE, "worker gpu-7-5555 speaks protocol version 9, this gateway "
                                                 "speaks 1", False),
             WorkerError(ErrorCode.INTERNAL, "engine crashed at tcp://10.1.2.3:5555", True),
             WorkerError(ErrorCode.BAD_REQUEST, "bad sampling (worker tcp://10.1.2.3:5555)", False)]
    for error in cases:
        for tokens in ([], [100]):
            gen = make(model, Failing(tokens, error))  # type: ignore[arg-type]
            with pytest.raises(ApiError) as exc:
                while await gen.next() is not None:
                    pass
            await gen.close()
            text = exc.value.message
            assert "tcp://" not in text and "10.1.2.3" not in text and "gpu-7" not in text, text


async def test_a_lost_lease_ends_the_stream(model):
    gen = make(model, Failing([100, 101, 102, 103], None))  # type: ignore[arg-type]
    ticket = with_ticket(gen)
    assert await gen.next() is not None
    ticket.reservation.lease_lost = True  # the renewer found it expired and the tenant at max_concurrent
    with pytest.raises(ApiError) as exc:
        await gen.next()
    await gen.close()
    assert exc.value.status == 429 and exc.value.code == "concurrency_lease_lost"
