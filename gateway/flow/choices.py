"""Requests with several choices (`n`, a batch of prompts), tool calls or `echo`: one admission, one worker
stream per choice, their deltas merged into OpenAI bodies and chunks that carry each choice's `index`.

A streamed group records each delta it frames as a step (the choice, the tokens it took, its finish), so a
stream another gateway carries on (`gateway.streams.carry_on`) replays the same steps through the same
framing, in the same order, before its live tail."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

from admission import AdmissionTicket
from gateway.flow.generation import Delta, Generation, Prepared, close_stack
from gateway.openai.bodies import TokenLogprob, Usage, _chat_logprobs, _completion_logprobs
from gateway.openai.tool_output import ToolCallStream
from gateway.telemetry import gateway_metrics
from gateway.web.api_errors import ApiError
from gateway.web.sse import DONE, event

log = logging.getLogger("switchyard.gateway")
FINISH_CODES = {"stop": 1, "length": 2}  # a step's code: new tokens * 4 + finish (0 none)


@dataclass(slots=True)
class _Choice:
    index: int
    gen: Generation
    echo: str  # completions `echo`: the prompt's text, sent before the choice's own
    tools: ToolCallStream | None
    first: bool = True
    done: bool = False  # its finish was framed
    taken: int = 0  # of gen.token_ids, recorded in steps
    offset: int = 0  # completions: text offset of the next chunk
    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def finish_reason(self) -> str | None:
        reason = self.gen.finish_reason
        if reason == "stop" and self.tools is not None and self.tools.calls:
            return "tool_calls"
        return reason


@dataclass(slots=True)
class GenerationGroup:
    """All choices of one request; close exactly once (aborts what still runs, then settles admission)."""

    prepared: Prepared
    gens: list[Generation]
    stack: AsyncExitStack
    usage: Usage
    headers: dict[str, str]
    replay: list[int] = field(default_factory=list)  # a carried stream: the logged steps' choices, in order
    choices: list[_Choice] = field(init=False)
    _steps: tuple[list[int], list[int], list[int]] = field(init=False)  # tokens, codes, choices
    _closed: bool = False

    def __post_init__(self) -> None:
        p = self.prepared
        tools = p.req.tools is not None and p.req.tools.active
        self.choices = [_Choice(i, g, self._echo_text(i // p.req.n),
                                ToolCallStream(f"{p.shape.id}:{i}") if tools else None)
                        for i, g in enumerate(self.gens)]
        self._steps = ([], [], [])

    def _echo_text(self, prompt_index: int) -> str:
        req = self.prepared.req
        if not req.echo or req.prompts is None:
            return ""
        prompt = req.prompts[prompt_index]
        if isinstance(prompt, str):
            return prompt
        table = self.gens[0].model.byte_table
        return b"".join(table[t] for t in prompt).decode("utf-8", "replace")

    async def collect(self) -> dict:
        """Run every choice to its end: the non-streaming body."""
        tasks = [asyncio.ensure_future(c.gen.collect()) for c in self.choices]
        try:
            results = await asyncio.gather(*tasks)
        finally:
            await _cancel(tasks)
        body = self.prepared.shape._head("chat.completion" if self.prepared.shape.chat else "text_completion")
        body["choices"] = [self._full_choice(c, text, lps) for c, (text, lps) in zip(self.choices, results,
                                                                                     strict=True)]
        body["usage"] = self.usage.to_dict()
        return body

    def _full_choice(self, c: _Choice, text: str, logprobs: list[TokenLogprob] | None) -> dict:
        if not self.prepared.shape.chat:
            return {"index": c.index, "text": c.echo + text, "logprobs": _completion_logprobs(logprobs, 0),
                    "finish_reason": c.finish_reason}
        message: dict = {"role": "assistant", "content": text}
        if c.tools is not None:
            content, _ = c.tools.feed(text)
            content += c.tools.finish()[0]
            message["content"] = content if c.tools.mode == "text" else None
            if c.tools.calls:
                message["tool_calls"] = [call.to_dict() for call in c.tools.calls]
        return {"index": c.index, "message": message, "logprobs": _chat_logprobs(logprobs),
                "finish_reason": c.finish_reason}

    async def events(self) -> AsyncIterator[dict]:
        """Streaming: one chunk per choice delta, in arrival order (a carried stream's logged steps first, in
        their order), then the usage chunk if asked for."""
        for index in self.replay:
            c = self.choices[index]
            chunk = self._frame(c, await c.gen.next())
            if chunk is not None:
                yield chunk
        if self.replay:
            self._steps = ([], [], [])  # the log holds them
        pending = {asyncio.ensure_future(c.gen.next()): c for c in self.choices if not c.done}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in sorted(done, key=lambda f: pending[f].index):
                    c = pending.pop(fut)
                    delta = fut.result()
                    chunk = self._frame(c, delta)
                    if chunk is not None:
                        yield chunk
                    if delta is not None and delta.finish_reason is None:
                        pending[asyncio.ensure_future(c.gen.next())] = c
        finally:
            await _cancel(list(pending))

    def _frame(self, c: _Choice, delta: Delta | None) -> dict | None:
        """The chunk of one delta (None: nothing to send yet), its step recorded."""
        if delta is None:
            return None
        ids = c.gen.token_ids
        tokens, codes, choices = self._steps
        tokens += ids[c.taken:]
        codes.append((len(ids) - c.taken) * 4 + FINISH_CODES.get(delta.finish_reason or "", 0))
        choices.append(c.index)
        c.taken = len(ids)
        c.done = delta.finish_reason is not None
        return self._chunk(c, delta)

    def take_steps(self) -> tuple[list[int], list[int], list[int], int]:
        """The steps framed since the last call (tokens, per step code and choice), and the cached prompt
        tokens so far (`gateway.streams.event_log` logs them with each event)."""
        steps, self._steps = self._steps, ([], [], [])
        return (*steps, self.usage.cached_tokens)

    @property
    def open_choices(self) -> int:
        return sum(not c.done for c in self.choices)

    @property
    def ticket(self) -> AdmissionTicket | None:
        return self.gens[0].ticket if self.gens else None

    def hand_over(self) -> None:
        """Another gateway carries this stream on and settles it: closing it here aborts, charges nothing."""
        if self.gens:
            self.gens[0].hand_over()  # the choices share one ticket and one money hold

    def _chunk(self, c: _Choice, delta: Delta) -> dict | None:
        shape, req = self.prepared.shape, self.prepared.req
        text = delta.text
        if c.first:
            text = c.echo + text
        done = delta.finish_reason is not None
        if shape.chat:
            choice = self._chat_delta(c, text, done, delta)
            if choice is None:
                return None
        else:
            choice = {"index": c.index, "text": text,
                      "logprobs": _completion_logprobs(delta.logprobs, c.offset),
                      "finish_reason": c.finish_reason if done else None}
            c.offset += len(text)
        c.first = False
        body = shape._head("chat.completion.chunk" if shape.chat else "text_completion")
        body["choices"] = [choice]
        if req.include_usage:
            body["usage"] = None
        return body

    def _chat_delta(self, c: _Choice, text: str, done: bool, delta: Delta) -> dict | None:
        calls: list[dict] = []
        if c.tools is not None:
            text, calls = c.tools.feed(text)
            if done:
                more, tail = c.tools.finish()
                text, calls = text + more, calls + tail
        out: dict = {"role": "assistant"} if c.first else {}
        if text or (c.first and not calls):
            out["content"] = text
        if calls:
            out["tool_calls"] = calls
        if not done and not delta.logprobs and not text and not calls and not c.first:
            return None
        return {"index": c.index, "delta": out, "logprobs": _chat_logprobs(delta.logprobs),
                "finish_reason": c.finish_reason if done else None}

    async def close(self) -> None:
        """Abort the choices still running and settle admission; idempotent, cancel-safe."""
        if self._closed:
            return
        self._closed = True
        await close_stack(self.stack, self.prepared.request_id)

    @property
    def finished(self) -> bool:
        return all(g.finish_reason is not None for g in self.gens)


async def group_sse(group: GenerationGroup, first: dict | None,
                    events: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """A group's SSE events: its chunks (`first`, then `events`), the usage chunk if asked for, `[DONE]`."""
    try:
        chunk = first
        while chunk is not None:
            if not group.open_choices:
                await group.close()  # settle (the lease goes) before the client sees the end and sends again
            yield event(chunk)
            chunk = await anext(events, None)
    except ApiError as exc:
        gateway_metrics.current().stream_errors.labels(str(exc.status)).inc()
        yield event(exc.body())
        return
    finally:
        await events.aclose()
    if not group.open_choices:
        await group.close()
    if group.prepared.req.include_usage:
        yield event(group.prepared.shape.usage_chunk(group.usage))
    yield DONE


async def _cancel(tasks: list[asyncio.Future]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(BaseException):
            await t
