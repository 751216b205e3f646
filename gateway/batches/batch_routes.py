"""`/v1/batches` handlers (create, retrieve, list, cancel) and `service_execute`, which runs one batch line
through the same parsing, admission, billing and routing as an interactive request, as `batch` priority."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.batches.batch_store import MAX_PER_TENANT, WINDOW_S, Batch, BatchStore, new_batch_id
from gateway.files.file_routes import BATCH_URLS, file_not_found
from gateway.flow.service import GatewayService
from gateway.openai.responses_shape import parse_responses
from gateway.openai.schemas import GenerationRequest, parse_chat, parse_completion
from gateway.web import api_errors
from gateway.web.api_errors import ApiError
from worker.protocol import Priority

PARSERS = {"/v1/chat/completions": parse_chat, "/v1/completions": parse_completion,
           "/v1/responses": parse_responses}
CREATE_FIELDS = frozenset({"input_file_id", "endpoint", "completion_window", "metadata"})
MAX_LIST = 100


def batch_not_found(batch_id: str) -> ApiError:
    return ApiError(404, f"No such Batch object: {batch_id}", param="batch_id", code="not_found")


def _not_cancellable(status: str) -> ApiError:
    return ApiError(409, f"Cannot cancel a batch with status '{status}'.", code="batch_not_cancellable")


def _store(request: Request) -> BatchStore:
    store = getattr(request.app.state, "batches", None)
    if store is None:
        raise ApiError(404, "This gateway serves no Batch API (no files directory).", code="not_found")
    return store


def parse_line(endpoint: str, body: Any) -> GenerationRequest:
    """A line's body parsed as an interactive request to `endpoint`; streams and background refused."""
    req = PARSERS[endpoint](body)
    if req.stream:
        raise api_errors.invalid("A batch request cannot stream.", param="stream")
    if req.background:
        raise api_errors.invalid("A batch request cannot run in the background.", param="background")
    req.priority = Priority.BATCH
    req.batch_line = True
    return req


async def service_execute(svc: GatewayService, tenant_name: str, batch: Batch,
                          body: dict) -> tuple[int, dict]:
    """One line, admitted under the tenant's budgets as batch work: (status code, body) as the API answers."""
    tenant = await svc.tenants.tenant(tenant_name)
    if tenant is None or not tenant.active:
        gone = api_errors.ApiError(401, "The batch's project is no longer active.", code="invalid_api_key")
        return 401, gone.body()
    try:
        req = parse_line(batch.endpoint, body)
        p = await asyncio.to_thread(svc.prepare, tenant, req, f"{batch.id}-line")
        if p.grouped:
            group = await svc.start_group(p)
            try:
                return 200, await group.collect()
            finally:
                await group.close()
        gen = await svc.start(p)
        try:
            text, logprobs = await gen.collect()
        finally:
            await gen.close()
        assert gen.finish_reason is not None
        return 200, p.shape.full(text, gen.finish_reason, gen.usage, logprobs)
    except ApiError as exc:
        return exc.status, exc.body()


def _validate(svc: GatewayService, tenant: Any, endpoint: str, lines: list[dict]) -> list[dict]:
    """Every line checked as an interactive request would be; the errors in the batch object's shape."""
    found = []
    for n, line in enumerate(lines, start=1):
        try:
            if line["url"] != endpoint:
                raise api_errors.invalid(f"The line's url {line['url']!r} is not the batch's endpoint.",
                                         param="url")
            svc.prepare(tenant, parse_line(endpoint, line["body"]), "validate")
        except ApiError as exc:
            found.append({"code": exc.code or "invalid_request", "message": exc.message, "param": exc.param,
                          "line": n})
        if len(found) >= 100:
            break
    return found


def _read_lines(path: Any) -> tuple[list[dict], list[int]]:
    """The file's request lines and the byte offset of each (blank lines skipped)."""
    lines: list[dict] = []
    offsets: list[int] = []
    at = 0
    with open(path, "rb") as fh:
        for raw in fh:
            if raw.strip():
                lines.append(json.loads(raw))
                offsets.append(at)
            at += len(raw)
    return lines, offsets


async def create(request: Request) -> Response:
    svc: GatewayService = request.app.state.service
    tenant = await svc.authenticate(request.headers.get("authorization"))
    store, files = _store(request), request.app.state.files
    body = await request.json()
    if not isinstance(body, dict):
        raise api_errors.invalid("The body must be a JSON object.")
    unknown = sorted(set(body) - CREATE_FIELDS)
    if unknown:
        raise api_errors.invalid(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
    endpoint, window = body.get("endpoint"), body.get("completion_window")
    if endpoint not in BATCH_URLS:
        raise api_errors.invalid(f"'endpoint' must be one of {', '.join(sorted(BATCH_URLS))}.",
                                 param="endpoint")
    if window not in WINDOW_S:
        raise api_errors.invalid("'completion_window' must be '24h'.", param="completion_window")
    meta = body.get("metadata")
    if meta is not None and (not isinstance(meta, dict) or len(meta) > 16
                             or not all(isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                                        for k, v in meta.items())):
        raise api_errors.invalid("'metadata' holds at most 16 string pairs (keys 64, values 512 characters).",
                                 param="metadata")
    file_id = body.get("input_file_id")
    path = None
    if isinstance(file_id, str):
        path = await asyncio.to_thread(files.content_path, tenant.name, file_id)
    if path is None:
        raise file_not_found(str(file_id))
    if await store.count(tenant.name) >= store.max_per_tenant:
        raise api_errors.invalid(f"This key's project holds {store.max_per_tenant} batches, the most it may.",
                                 param="input_file_id", code="batch_quota_exceeded")
    now = int(time.time())
    batch = Batch(new_batch_id(), endpoint, file_id, window, "validating", now, now + WINDOW_S[window],
                  metadata=meta)
    await store.save(tenant.name, batch)
    lines, offsets = await asyncio.to_thread(_read_lines, path)
    found = await asyncio.to_thread(_validate, svc, tenant, endpoint, lines)
    batch.counts = {"total": len(lines), "completed": 0, "failed": 0}
    batch.total = len(lines)
    if found:
        batch.status, batch.failed_at = "failed", int(time.time())
        batch.errors = {"object": "list", "data": found}
    else:
        batch.status, batch.in_progress_at = "in_progress", int(time.time())
    await store.save(tenant.name, batch)
    if not found:
        await store.enqueue(tenant.name, batch.id, offsets)
    return JSONResponse(batch.to_dict())


async def retrieve(request: Request) -> Response:
    svc: GatewayService = request.app.state.service
    tenant = await svc.authenticate(request.headers.get("authorization"))
    batch_id = request.path_params["batch_id"]
    batch = await _store(request).get(tenant.name, batch_id)
    if batch is None:
        raise batch_not_found(batch_id)
    return JSONResponse(await _with_counts(request, tenant.name, batch))


async def _with_counts(request: Request, tenant: str, batch: Batch) -> dict:
    """In progress: the counts of the results recorded so far."""
    if batch.status in ("in_progress", "cancelling", "finalizing"):
        done = await _store(request).results(tenant, batch.id)
        ok = sum(1 for r in done.values() if r.get("status_code") == 200)
        batch.counts = {"total": batch.total, "completed": ok,
                        "failed": sum(1 for r in done.values() if not r.get("skip")) - ok}
    return batch.to_dict()


async def list_batches(request: Request) -> Response:
    svc: GatewayService = request.app.state.service
    tenant = await svc.authenticate(request.headers.get("authorization"))
    q = request.query_params
    unknown = sorted(set(q.keys()) - {"after", "limit"})
    if unknown:
        raise api_errors.invalid(f"Unrecognized query parameter: {unknown[0]!r}.", param=unknown[0])
    limit = int(q["limit"]) if q.get("limit", "20").isdigit() and "limit" in q else 20
    if not 1 <= limit <= MAX_LIST:
        raise api_errors.invalid(f"'limit' must be an integer from 1 to {MAX_LIST}.", param="limit")
    store = _store(request)
    ids = list(reversed(await store.ids(tenant.name)))  # newest first, as OpenAI lists
    if "after" in q:
        ids = ids[ids.index(q["after"]) + 1:] if q["after"] in ids else []
    found = [b for b in [await store.get(tenant.name, i) for i in ids[:limit]] if b is not None]
    data = [b.to_dict() for b in found]
    return JSONResponse({"object": "list", "data": data, "has_more": len(ids) > limit,
                         "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None})


async def cancel(request: Request) -> Response:
    svc: GatewayService = request.app.state.service
    tenant = await svc.authenticate(request.headers.get("authorization"))
    batch_id = request.path_params["batch_id"]
    store = _store(request)
    batch = await store.get(tenant.name, batch_id)
    if batch is None:
        raise batch_not_found(batch_id)
    if batch.status in ("cancelling", "cancelled"):
        return JSONResponse(batch.to_dict())
    if batch.status not in ("validating", "in_progress"):
        raise _not_cancellable(batch.status)
    batch = await store.update(tenant.name, batch_id, ("validating", "in_progress"), status="cancelling",
                               cancelling_at=int(time.time()))
    if batch is None:
        raise batch_not_found(batch_id)
    if batch.status not in ("cancelling", "cancelled"):  # it ended meanwhile
        raise _not_cancellable(batch.status)
    runner = getattr(request.app.state, "batch_runner", None)
    if runner is not None:
        await runner.maybe_finalize(tenant.name, batch_id)  # every line may be in already
    return JSONResponse(batch.to_dict())


__all__ = ["MAX_PER_TENANT", "cancel", "create", "list_batches", "retrieve", "service_execute"]
