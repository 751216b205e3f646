"""Generation: worker token chunks -> text deltas, with the real tokenizer and real token ids.

The chunks are scripted (as the worker would send them: one token each, the last
one with a finish reason), so that multi-byte characters split across tokens,
stop strings and usage can be checked exactly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import pytest

from gateway.model import ServedModel
from gateway.responses import ResponseShape, Usage
from gateway.schemas import parse_completion
from gateway.service import Generation, Prepared
from tenancy.schema import Tenant
from worker.protocol import OutItem, Priority

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
