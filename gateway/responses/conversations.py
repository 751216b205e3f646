"""Stored responses as the request path uses them: look up, delete, continue a conversation, save a result."""

from __future__ import annotations

from gateway.openai import responses_shape
from gateway.openai.responses_items import assistant_turn, input_items
from gateway.openai.schemas import GenerationRequest
from gateway.responses.response_store import ResponseStore, reported
from gateway.web import api_errors
from gateway.web.api_errors import ApiError, invalid
from tenancy import Tenant


class Conversations:
    """The tenant-scoped face of a `ResponseStore` (None: nothing is stored, every id is a 404)."""

    def __init__(self, store: ResponseStore | None) -> None:
        self.store = store

    async def stored_response(self, tenant: Tenant, response_id: str) -> dict:
        """A stored response of this tenant's (404 for any other: another tenant's id is not found either)."""
        found = await self.store.get(tenant.name, response_id) if self.store is not None else None
        if found is None:
            raise api_errors.response_not_found(response_id)
        return found

    async def delete_response(self, tenant: Tenant, response_id: str) -> None:
        if self.store is None or not await self.store.delete(tenant.name, response_id):
            raise api_errors.response_not_found(response_id)

    async def continue_previous(self, tenant: Tenant, req: GenerationRequest) -> None:
        """Prepend the previous response's conversation (its instructions are not carried over)."""
        if req.previous_response_id is None:
            return
        try:
            prev = await self.stored_response(tenant, req.previous_response_id)
        except ApiError as exc:
            exc.message, exc.param = f"Previous response with id '{req.previous_response_id}' not found.", \
                "previous_response_id"
            raise
        status = reported(prev)["status"]
        if status in ("queued", "in_progress"):
            raise invalid(f"Previous response '{req.previous_response_id}' is still {status}; continue from "
                          "it once it has ended.", param="previous_response_id")
        assert req.conversation is not None
        req.conversation = prev["conversation"] + req.conversation
        req.messages = responses_shape.with_instructions(req.instructions, req.conversation)

    async def save_response(self, tenant: Tenant, req: GenerationRequest, body: dict) -> bool:
        """Store a finished response when asked (`store`); True when it was stored."""
        if not req.store or self.store is None or req.conversation is None:
            return False
        return await self.store.save(tenant.name, body, *_stored(req, body))

    async def save_background(self, tenant: Tenant, req: GenerationRequest, body: dict, deadline: float, *,
                              start: bool = False, final: bool = False) -> bool:
        """Store a background run's response: its start, progress or end."""
        assert self.store is not None and req.conversation is not None
        if start:
            return await self.store.save(tenant.name, body, *_stored(req, body), run_deadline=deadline)
        return await self.store.save_run(tenant.name, body, *_stored(req, body), run_deadline=deadline,
                                         final=final)


def _stored(req: GenerationRequest, body: dict) -> tuple[list[dict], list[dict]]:
    """A response's input items and the conversation it continues with (its answer once it has ended)."""
    assert req.conversation is not None
    turns = req.conversation
    ended = body["status"] not in ("queued", "in_progress")
    return (input_items(turns, req.new_turns),
            [*turns, assistant_turn(body["output"])] if ended else list(turns))
