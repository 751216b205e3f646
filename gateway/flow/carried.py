"""A stream carried on from a lost gateway: its logged tokens replayed, in the groups its events were made
from, then the worker's continuation (the prompt plus those tokens), under the reservations it holds."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from typing import Any

from admission import Reservation
from gateway.flow.generation import Generation, Prepared
from gateway.openai.bodies import Usage
from worker.protocol import OutItem

FINISHES = {1: "stop", 2: "length"}


def groups(tokens: list[int], codes: list[int]) -> list[tuple[list[int], str | None]]:
    """The logged tokens cut as the first gateway consumed them: one group per event that took tokens or saw
    the finish (`event_log.CODES`)."""
    out, at = [], 0
    for code in codes:
        n, finish = code >> 2, FINISHES.get(code & 3)
        if n or finish:
            out.append((tokens[at:at + n], finish))
        at += n
    return out


async def replayed_then_live(rid: str, logged: list[tuple[list[int], str | None]], first_cached: int,
                             max_tokens: int,
                             live: Callable[[], AsyncIterator[OutItem]]) -> AsyncIterator[OutItem]:
    """The logged groups as worker chunks, then (unless they finished) the live continuation."""
    sent = 0
    for tokens, finish in logged:
        sent += len(tokens)
        yield OutItem(rid, tokens, finish, first_cached, None)
        if finish is not None:
            return
    if sent >= max_tokens:  # the first gateway consumed the last token but did not log the finish
        yield OutItem(rid, [], "length", first_cached, None)
        return
    chunks = live()
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


async def start_carried(svc: Any, p: Prepared, reservation: Reservation | None, hold: Any,
                        logged: list[tuple[list[int], str | None]], first_cached: int) -> Generation:
    """The carried stream's `Generation` (close it): no new admission; its reservation and money hold are
    settled here, once, with the whole stream's usage."""
    stack = AsyncExitStack()
    usage = Usage(prompt_tokens=len(p.prompt_ids))
    target = svc._target(p)
    ticket = None
    try:
        if reservation is not None and svc.admission is not None:
            ticket = await stack.enter_async_context(svc.admission.carried(reservation))
            stack.callback(lambda: ticket.record_usage(usage.prompt_tokens, usage.completion_tokens,
                                                       usage.cached_tokens))
        if hold is not None and svc.money is not None:
            money = svc.money
            stack.push_async_callback(lambda: money.settle(hold, True, usage.prompt_tokens,
                                                           usage.cached_tokens, usage.completion_tokens))
        streamed = [t for tokens, _ in logged for t in tokens]
        route = svc.route_request(p, streamed=streamed, first_cached=first_cached)
        route.rid = f"{p.shape.id}-c{secrets.token_hex(3)}"  # the lost gateway's may still be on a worker
        chunks = replayed_then_live(route.rid, logged, first_cached, p.max_tokens,
                                    lambda: target.router.stream(route))
        stack.push_async_callback(chunks.aclose)
    except BaseException:
        await stack.aclose()
        raise
    return Generation(target.model, p, chunks, stack, usage, {}, svc.config.first_token_timeout_s, ticket,
                      tenants=svc.tenants)
