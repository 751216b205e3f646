"""The Starlette application: routes, lifecycle and response framing (HTTP only; request flow: `service`).

A generation is closed exactly once whatever happens: the worker request aborted, the reservation settled.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from opentelemetry.trace import Span, use_span
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.admin import admin_routes
from gateway.batches import batch_routes
from gateway.batches.lifecycle import start_batches, stop_batches
from gateway.files import file_routes
from gateway.files.file_store import DirectoryFileStore
from gateway.flow.choices import GenerationGroup, group_sse
from gateway.flow.deadlines import TTFT_HEADER, header_target_ms
from gateway.flow.generation import Delta, Generation, Prepared
from gateway.flow.info_routes import get_model, health, list_models, ready
from gateway.flow.service import GatewayService
from gateway.openai.openapi import openapi_endpoint
from gateway.openai.responses_shape import parse_responses
from gateway.openai.schemas import GenerationRequest, body_number_cap, parse_chat, parse_completion
from gateway.responses.background import BackgroundRuns
from gateway.responses.conversations import Conversations
from gateway.responses.response_events import stream_events
from gateway.responses.response_store import ResponseStore
from gateway.responses.routes import cancel_response, stored_response
from gateway.streams import resume_routes
from gateway.streams.carry_on import CarryOn
from gateway.streams.hooks import resumable
from gateway.telemetry import gateway_metrics, gateway_spans
from gateway.web import api_errors
from gateway.web.api_errors import ApiError, install_handlers
from gateway.web.drain_middleware import DrainMiddleware, DrainState
from gateway.web.request_io import (
    ClientGone,
    CloseUnreadBodyMiddleware,
    RequestIdMiddleware,
    read_json,
    until_disconnect,
)
from gateway.web.sse import DONE, SSEResponse, event, install_log_filter
from tenancy import Tenant

log = logging.getLogger("switchyard.gateway")
_T = TypeVar("_T")

CLIENT_CLOSED = 499  # nginx's convention for "client closed the request"; never seen by the client


@dataclass(slots=True)
class AppConfig:
    max_body_bytes: int = 4 * 1024 * 1024
    body_timeout_s: float = 10.0  # the whole body must arrive within this (408 otherwise)
    stream_write_timeout_s: float = 30.0  # an SSE client that takes no chunk for this long is cut
    ready_check: Callable[[], Awaitable[bool]] | None = None  # e.g. a Redis ping
    metrics_token: str | None = None  # /metrics off loopback needs it as a bearer token (gateway_metrics)
    trace_tenant: bool = False  # request spans carry the tenant's name (`switchyard.tenant`)
    trust_client_trace: bool = False  # a client's traceparent parents the request span (else: a link only)
    files_dir: str | None = None  # the Files API's directory (gateway.files); None: /v1/files answers 404
    batch_concurrency: int = 4  # batch lines this gateway runs at once (gateway.batches)
    batch_claim_idle_s: float = 60.0  # a line claimed this long and not answered is taken over elsewhere
    event_logs: Any = None  # gateway.streams.event_log.EventLogs: event ids, resumable streams; None: off
    stream_detach_grace_s: float = 0.0  # a stream whose client left runs on this long for a reconnect
    carry_on: bool = True  # with event logs: a lost gateway's streams are carried on by a reconnect


def _service(request: Request) -> GatewayService:
    return request.app.state.service


async def _generate(request: Request, parse: Callable[[Any], GenerationRequest]) -> Response:
    span = gateway_spans.start_request(request, request.app.state.config.trust_client_trace)
    if span is None:
        return await _serve(request, parse, None)
    with use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
        try:
            response = await _serve(request, parse, span)
        except ApiError as exc:
            gateway_spans.finish(span, exc.status, error_code=exc.code or "")
            raise
        except BaseException:
            gateway_spans.finish(span, 500)
            raise
    if not isinstance(response, SSEResponse):  # a stream's span ends with the stream (`_close`)
        gateway_spans.finish(span, response.status_code)
    return response


async def _serve(request: Request, parse: Callable[[Any], GenerationRequest], span: Span | None) -> Response:
    svc = _service(request)
    arrived = time.perf_counter()
    rid = request.scope["state"]["request_id"]
    with gateway_spans.child("authenticate"):
        tenant = await svc.authenticate(request.headers.get("authorization"))
    config = request.app.state.config
    if span is not None and config.trace_tenant:
        span.set_attribute("switchyard.tenant", tenant.name)
    svc.check_invalid_lockout(tenant)  # before any parsing: see GatewayService.charge_invalid
    try:
        req, prepared = await _read_and_prepare(request, svc, tenant, parse, rid)
    except ApiError as exc:
        if 400 <= exc.status < 500:
            await svc.charge_invalid(tenant)
        raise
    prepared.key_digest = svc.key_digest(request.headers.get("authorization"))
    version = prepared.target.key if prepared.target is not None else ""
    trace = gateway_metrics.current().trace(prepared.priority.label, tenant.name, arrived, version)
    if prepared.grouped:
        return await _generate_group(request, svc, prepared, trace, span)
    if req.background:
        return await _start_background(request, svc, prepared, trace)
    with gateway_spans.child("admission", priority=prepared.priority.label,
                             prompt_tokens=len(prepared.prompt_ids), max_tokens=prepared.max_tokens):
        gen = await _refused_counted(svc.start(prepared), trace)
    trace.admitted()
    try:
        if req.stream:
            first = await until_disconnect(request, gen.next())
            trace.first_token(gen.usage.completion_tokens)
            body = _stream_body(request.app.state.conversations, req.api, gen, first, trace, req)
            body, closer = resumable(config, prepared, body, functools.partial(_close, gen, trace, span),
                                     request.app.state.drain, gen=gen)
            response: Response = SSEResponse(body, closer, headers=gen.headers,
                                             write_timeout_s=config.stream_write_timeout_s)
            gen = None  # the response owns it now
            return response
        text, logprobs = await until_disconnect(request, gen.collect())
        assert gen.finish_reason is not None
        body = prepared.shape.full(text, gen.finish_reason, gen.usage, logprobs)
        if req.api == "responses":
            body["store"] = await request.app.state.conversations.save_response(tenant, req, body)
        return JSONResponse(body, headers=gen.headers)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    except ApiError as exc:
        exc.headers = {**(gen.headers if gen else {}), **exc.headers}
        raise
    finally:
        if gen is not None:
            await _close(gen, trace, span)


async def _read_and_prepare(request: Request, svc: GatewayService, tenant: Tenant,
                            parse: Callable[[Any], GenerationRequest],
                            rid: str) -> tuple[GenerationRequest, Prepared]:
    config = request.app.state.config
    # a token-id prompt longer than the context is refused while the body is decoded
    body, raw = await read_json(request, config.max_body_bytes, config.body_timeout_s,
                                max_numbers=body_number_cap(svc.model.max_context))
    req, prepared = await svc.parse_and_prepare(tenant, functools.partial(parse, body), len(raw), rid,
                                                request.app.state.conversations.continue_previous)
    prepared.ttft_slo_ms = header_target_ms(prepared.ttft_slo_ms, request.headers.get(TTFT_HEADER))
    prepared.raw_body = raw  # a stream another gateway may carry on keeps the body as sent
    return req, prepared


async def _refused_counted(started: Awaitable[_T], trace: gateway_metrics.RequestTrace) -> _T:
    """Await a generation's start; a refusal (no worker, capacity, quota) counts as its version's error."""
    try:
        return await started
    except ApiError:
        trace.refused()
        raise


async def _start_background(request: Request, svc: GatewayService, prepared: Prepared,
                            trace: gateway_metrics.RequestTrace) -> Response:
    """`background: true`: admit now (a refusal is this POST's error), then run as a task; answer `queued`."""
    runs: BackgroundRuns = request.app.state.background
    run = runs.reserve(prepared.tenant.name, prepared.shape.id)  # 429/503 past the bounds, before any charge
    try:
        with gateway_spans.child("admission", priority=prepared.priority.label,
                                 prompt_tokens=len(prepared.prompt_ids), max_tokens=prepared.max_tokens):
            gen = await _refused_counted(svc.start(prepared), trace)
    except BaseException:
        runs.release(run)
        raise
    trace.admitted()
    body = await runs.launch(run, gen, trace, functools.partial(_close, gen, trace, None))
    return JSONResponse(body, headers=gen.headers)


async def _generate_group(request: Request, svc: GatewayService, prepared: Prepared,
                          trace: gateway_metrics.RequestTrace, span: Span | None) -> Response:
    """Several choices, tool calls or echo (`gateway.flow.choices`): the same framing as one stream."""
    with gateway_spans.child("admission", priority=prepared.priority.label, max_tokens=prepared.max_tokens,
                             choices=prepared.choices):
        group: GenerationGroup | None = await _refused_counted(svc.start_group(prepared), trace)
    assert group is not None
    trace.admitted()
    try:
        if prepared.req.stream:
            events = group.events()
            first = await until_disconnect(request, anext(events, None))
            trace.first_token(group.usage.completion_tokens)
            body, closer = resumable(request.app.state.config, prepared, group_sse(group, first, events),
                                     functools.partial(_close, group, trace, span), request.app.state.drain,
                                     gen=group)
            response: Response = SSEResponse(body, closer, headers=group.headers,
                                             write_timeout_s=request.app.state.config.stream_write_timeout_s)
            group = None  # the response owns it now
            return response
        return JSONResponse(await until_disconnect(request, group.collect()), headers=group.headers)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    except ApiError as exc:
        exc.headers = {**(group.headers if group else {}), **exc.headers}
        raise
    finally:
        if group is not None:
            await _close(group, trace, span)


async def _close(gen: Generation | GenerationGroup, trace: gateway_metrics.RequestTrace,
                 span: Span | None) -> None:
    await gen.close()
    u = gen.usage
    done = gen.finished if isinstance(gen, GenerationGroup) else gen.finish_reason is not None
    trace.finished(u.prompt_tokens, u.completion_tokens, u.cached_tokens, done)
    gateway_spans.finish(span, 200, prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                         cached_tokens=u.cached_tokens, finished=done)


def _stream_body(conversations: Conversations, api: str, gen: Generation, first: Delta | None,
                 trace: gateway_metrics.RequestTrace, req: GenerationRequest) -> AsyncIterator[bytes]:
    """A single stream's SSE events (`api`: "responses", else chat or completions)."""
    if api == "responses":
        return stream_events(gen, first, trace,
                             functools.partial(conversations.save_response, gen.prepared.tenant, req))
    return _sse_body(gen, first, trace)


async def _sse_body(gen: Generation, first: Delta | None,
                    trace: gateway_metrics.RequestTrace) -> AsyncIterator[bytes]:
    shape = gen.prepared.shape
    usage_field = gen.prepared.req.include_usage
    offset = 0
    delta = first
    is_first = True
    try:
        while delta is not None:
            if delta.finish_reason is not None:
                await gen.close()  # settle (the lease goes) before the client can see the end and send again
            yield event(shape.chunk(delta.text, delta.finish_reason, delta.logprobs, first=is_first,
                                    text_offset=offset, with_usage_field=usage_field))
            offset += len(delta.text)
            is_first = False
            delta = await gen.next()
            trace.next_chunk(gen.usage.completion_tokens)
    except ApiError as exc:
        # Headers are gone: the SDKs raise on an `error` event.
        gateway_metrics.current().stream_errors.labels(str(exc.status)).inc()
        yield event(exc.body())
        return
    if usage_field:
        yield event(shape.usage_chunk(gen.usage))
    yield DONE


async def chat_completions(request: Request) -> Response:
    if "last-event-id" in request.headers:  # a reconnect: the stream's missed events, then its tail
        return await resume_routes.resume_completion(request)
    return await _generate(request, parse_chat)


async def completions(request: Request) -> Response:
    if "last-event-id" in request.headers:
        return await resume_routes.resume_completion(request)
    return await _generate(request, parse_completion)


async def responses(request: Request) -> Response:
    if "last-event-id" in request.headers:
        raise api_errors.invalid("A response stream resumes with GET /v1/responses/{id}?stream=true"
                                 "&starting_after=N.", param="Last-Event-ID")
    return await _generate(request, parse_responses)


def create_app(make_service: Callable[[], Awaitable[GatewayService]], config: AppConfig | None = None,
               on_close: Callable[[], Awaitable[None]] | None = None,
               response_store: ResponseStore | None = None, redis: Any | None = None) -> Starlette:
    """The app: `make_service` runs at startup, `on_close` at shutdown; `response_store` keeps responses."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.service = await make_service()
        app.state.background = BackgroundRuns(app.state.service, app.state.conversations, app.state.drain)
        app.state.background.logs = logs = app.state.config.event_logs
        if logs is not None and app.state.config.carry_on:
            app.state.carry = CarryOn(logs, app.state.service,
                                      functools.partial(_stream_body, app.state.conversations),
                                      {"chat": parse_chat, "completions": parse_completion,
                                       "responses": parse_responses},
                                      app.state.conversations.continue_previous,
                                      app.state.background.carry_on)
            app.state.carry.start()
        start_batches(app)
        try:
            yield
        finally:
            await stop_batches(app)
            await app.state.background.shutdown()  # before the router and admission close under the runs
            if app.state.carry is not None:
                await app.state.carry.close()
            if app.state.config.event_logs is not None:
                await app.state.config.event_logs.close()  # streams whose client left end; a last flush
            await app.state.service.close()
            if on_close is not None:
                await on_close()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"]),
        Route("/v1/responses/{response_id}/input_items", stored_response, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"]),
        Route("/v1/files", file_routes.upload, methods=["POST"]),
        Route("/v1/files", file_routes.list_files, methods=["GET"]),
        Route("/v1/files/{file_id}", file_routes.one_file, methods=["GET", "DELETE"]),
        Route("/v1/files/{file_id}/content", file_routes.file_content, methods=["GET"]),
        Route("/v1/batches", batch_routes.create, methods=["POST"]),
        Route("/v1/batches", batch_routes.list_batches, methods=["GET"]),
        Route("/v1/batches/{batch_id}", batch_routes.retrieve, methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", batch_routes.cancel, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", gateway_metrics.guarded_endpoint(config.metrics_token if config else None),
              methods=["GET"]),
        Route("/openapi.json", openapi_endpoint, methods=["GET"]),
        *admin_routes.ROUTES,
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.config = config or AppConfig()
    app.state.started = int(time.time())
    app.state.drain = DrainState()  # flipped by gateway.web.drain_middleware.LameDuckServer on SIGTERM
    app.state.conversations = Conversations(response_store)
    app.state.carry = None  # gateway.streams.carry_on.CarryOn, made at startup when event logs are on
    app.state.redis = redis  # the gateway's Redis client (batches; None: no Batch API)
    app.state.files = DirectoryFileStore(config.files_dir) if config and config.files_dir else None
    install_handlers(app)
    install_log_filter()
    # outermost last: request id, then status counting and access log, then the lame-duck gate
    app.add_middleware(DrainMiddleware, state=app.state.drain)
    app.add_middleware(gateway_metrics.ObserveMiddleware)
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(CloseUnreadBodyMiddleware)
    return app
