"""A stream carried on from a lost gateway: its logged tokens replayed, in the groups its events were made
from (a group of choices: its logged steps, per choice), then the worker's continuation (the prompt plus
those tokens), under the reservations it holds."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from typing import Any

from admission import AdmissionTicket, Reservation
from gateway.flow.choices import GenerationGroup
from gateway.flow.generation import Generation, Prepared
from gateway.flow.versions import VERSION_HEADER
from gateway.openai.bodies import Usage
from worker.protocol import OutItem

FINISHES = {1: "stop", 2: "length"}
Group = tuple[list[int], str | None]  # the tokens one event (one step of a group) took, and its finish


def groups(tokens: list[int], codes: list[int]) -> list[Group]:
    """The logged tokens cut as the first gateway consumed them: one group per event that took tokens or saw
    the finish (`event_log.CODES`)."""
    out, at = [], 0
    for code in codes:
        n, finish = code >> 2, FINISHES.get(code & 3)
        if n or finish:
            out.append((tokens[at:at + n], finish))
        at += n
    return out


def choice_steps(tokens: list[int], codes: list[int], choices: list[int],
                 count: int) -> list[list[Group]]:
    """A group's logged steps, per choice (`event_log.CHOICES`); ValueError when one names no choice."""
    per: list[list[Group]] = [[] for _ in range(count)]
    at = 0
    for code, index in zip(codes, choices, strict=True):
        if not 0 <= index < count:
            raise ValueError(f"a logged step names choice {index} of {count}")
        n = code >> 2
        per[index].append((tokens[at:at + n], FINISHES.get(code & 3)))
        at += n
    return per


async def replayed_then_live(rid: str, logged: list[Group], first_cached: int, max_tokens: int,
                             live: Callable[[], AsyncIterator[OutItem]]) -> AsyncIterator[OutItem]:
    """The logged groups as worker chunks, then (unless they finished) the live continuation. Replayed
    chunks carry placeholder logprobs, so a stream that asks for them frames the same events."""
    sent = 0
    for tokens, finish in logged:
        sent += len(tokens)
        yield OutItem(rid, tokens, finish, first_cached, [0.0] * len(tokens))
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


async def _settled_here(svc: Any, stack: AsyncExitStack, reservation: Reservation | None, hold: Any,
                        usage: Usage) -> AdmissionTicket | None:
    """The first gateway's reservation and money hold, settled once, by `stack`, with the whole usage."""
    ticket = None
    if reservation is not None and svc.admission is not None:
        ticket = await stack.enter_async_context(svc.admission.carried(reservation))
        stack.callback(lambda: ticket.record_usage(usage.prompt_tokens, usage.completion_tokens,
                                                   usage.cached_tokens))
    if hold is not None and svc.money is not None:
        money = svc.money
        stack.push_async_callback(lambda: money.settle(hold, True, usage.prompt_tokens,
                                                       usage.cached_tokens, usage.completion_tokens))
    return ticket


def _carried_chunks(svc: Any, p: Prepared, route: Any, logged: list[Group], first_cached: int,
                    stack: AsyncExitStack) -> AsyncIterator[OutItem]:
    target = svc._target(p)
    route.rid = f"{route.rid}-c{secrets.token_hex(3)}"  # the lost gateway's may still be on a worker
    chunks = replayed_then_live(route.rid, logged, first_cached, p.max_tokens,
                                lambda: target.router.stream(route))
    stack.push_async_callback(chunks.aclose)
    return chunks


async def start_carried(svc: Any, p: Prepared, reservation: Reservation | None, hold: Any,
                        logged: list[Group], first_cached: int) -> Generation:
    """The carried stream's `Generation` (close it): no new admission; its reservation and money hold are
    settled here, once, with the whole stream's usage."""
    stack = AsyncExitStack()
    usage = Usage(prompt_tokens=len(p.prompt_ids))
    try:
        ticket = await _settled_here(svc, stack, reservation, hold, usage)
        streamed = [t for tokens, _ in logged for t in tokens]
        route = svc.route_request(p, streamed=streamed, first_cached=first_cached)
        chunks = _carried_chunks(svc, p, route, logged, first_cached, stack)
    except BaseException:
        await stack.aclose()
        raise
    return Generation(svc._target(p).model, p, chunks, stack, usage, {}, svc.config.first_token_timeout_s,
                      ticket, tenants=svc.tenants)


async def start_carried_group(svc: Any, p: Prepared, reservation: Reservation | None, hold: Any,
                              logged: list[list[Group]], order: list[int],
                              first_cached: int) -> GenerationGroup:
    """A carried group of choices (close it): each choice replays its logged steps, then carries on from
    its prompt plus their tokens; the group frames the steps again in `order` (the logged one) first."""
    stack = AsyncExitStack()
    usage = Usage(prompt_tokens=sum(map(len, p.prompts)))
    target = svc._target(p)
    gens: list[Generation] = []
    try:
        ticket = await _settled_here(svc, stack, reservation, hold, usage)
        for index, steps in enumerate(logged):
            streamed = [t for tokens, _ in steps for t in tokens]
            route = svc.choice_route(p, index, streamed=streamed, first_cached=first_cached,
                                     ttft_deadline=0.0)
            chunks = _carried_chunks(svc, p, route, steps, first_cached, stack)
            gens.append(Generation(target.model, p, chunks, AsyncExitStack(), usage, {},
                                   svc.config.first_token_timeout_s, ticket, tenants=svc.tenants))
    except BaseException:
        await stack.aclose()
        raise
    return GenerationGroup(p, gens, stack, usage, {VERSION_HEADER: target.key}, replay=order)
