"""A streamed Response: the typed events the `openai` SDK parses, by `sequence_number`, stored at the end."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from gateway.openai.responses_shape import ResponsesShape, final_status
from gateway.web.api_errors import ApiError
from gateway.web.sse import event_named

if TYPE_CHECKING:
    from gateway.flow.generation import Delta, Generation


async def stream_events(gen: Generation, first: Delta | None, trace: Any,
                        save: Callable[[dict], Awaitable[bool]]) -> AsyncIterator[bytes]:
    """`response.created` ... `response.completed` (or `.incomplete`); a mid-stream error is an `error` event.
    Items open as their text arrives: a message, or function calls (`response.function_call_arguments.*`)."""
    shape: ResponsesShape = gen.prepared.shape  # type: ignore[assignment]
    seq = 0

    def emit(kind: str, fields: dict[str, Any]) -> bytes:
        nonlocal seq
        seq += 1
        return event_named(kind, {"type": kind, "sequence_number": seq - 1, **fields})

    yield emit("response.created", {"response": shape.response("in_progress", [])})
    yield emit("response.in_progress", {"response": shape.response("in_progress", [])})
    items = shape.output_items()
    delta, finish = first, None
    try:
        while delta is not None:
            if delta.finish_reason is not None:
                finish = delta.finish_reason
                await gen.close()  # settle before the client can see the end
            for kind, fields in items.feed(delta.text):
                yield emit(kind, fields)
            delta = await gen.next()
            trace.next_chunk(gen.usage.completion_tokens)
    except ApiError as exc:
        err = exc.body()["error"]
        yield emit("error", {"code": err["code"], "message": err["message"], "param": err["param"]})
        return
    status = final_status(finish)
    for kind, fields in items.finish(status):
        yield emit(kind, fields)
    done = shape.response(status, items.items, finish, gen.usage)
    done["store"] = await save(done)
    yield emit(f"response.{done['status']}", {"response": done})
