"""The per-request flow of the gateway apart from HTTP framing: authenticate, prepare, admit, route,
then turn the worker's token stream into text deltas (`Generation`) and settle admission when it ends.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool

from admission import Admission, AdmissionTicket, MoneyGate, error_response
from common.priorities import Priority
from gateway.flow import deadlines
from gateway.flow.choices import GenerationGroup
from gateway.flow.generation import Generation, Prepared
from gateway.flow.money_step import MoneyStep
from gateway.flow.served_model import ServedModel
from gateway.flow.versions import VERSION_HEADER, ModelPools, SinglePool, Target, sticky_prefix
from gateway.openai import responses_shape
from gateway.openai.bodies import ResponseShape, Usage
from gateway.openai.schemas import GenerationRequest
from gateway.telemetry import gateway_metrics
from gateway.web import api_errors
from gateway.web.api_errors import ApiError, invalid
from gateway.web.request_io import THREAD_TOKENIZE_BYTES, bearer_key
from router import NoWorkerAvailable, Routed, Router, RouteRequest, fairness_key, namespace_root
from tenancy import QuotaServiceUnavailable, Tenant, TenantDirectory, key_digest
from worker.protocol import OutItem, SamplingParams

log = logging.getLogger("switchyard.gateway")


MAX_INVALID_LOCKOUTS = 10_000  # tenants remembered as out of requests after invalid ones (oldest dropped)


@dataclass(slots=True)
class ServiceConfig:
    request_timeout_s: float = 600.0  # whole-request deadline sent to the worker
    first_token_timeout_s: float = 120.0
    ttft_slo_ms: dict[Priority, int] = field(default_factory=dict)  # class default TTFT targets (0: none)


class GatewayService:
    def __init__(self, model: ServedModel, tenants: TenantDirectory, router: Router,
                 admission: Admission | None = None, config: ServiceConfig | None = None,
                 pools: ModelPools | None = None) -> None:
        self.model = model  # the gateway's own model (the default alias; body limits)
        self.tenants = tenants
        self.router = router  # the secret's holder; with model pools, each version has its own Router
        self.admission = admission
        self.config = config or ServiceConfig()
        self.pools: ModelPools = pools or SinglePool(model, router)
        self._invalid_until: dict[str, float] = {}  # tenant -> when it has a request left (charge_invalid)
        self.money: MoneyGate | None = None  # dollar budgets (settings.gateway.money_budgets)

    @property
    def ready(self) -> bool:
        return self.pools.ready()

    async def close(self) -> None:
        await self.pools.close()

    @staticmethod
    def key_digest(authorization: str | None) -> str:
        """SHA-256 digest of the request's bearer key ("" without one): streams re-check it is not revoked."""
        key = bearer_key(authorization)
        return key_digest(key) if key else ""

    async def authenticate(self, authorization: str | None) -> Tenant:
        key = bearer_key(authorization)
        if key is None:
            raise api_errors.unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
        try:
            tenant = await self.tenants.authenticate(key)
        except QuotaServiceUnavailable:
            gateway_metrics.current().count_shed("quota_service_unavailable")
            raise api_errors.quota_unavailable() from None
        if tenant is None:
            raise api_errors.unauthorized("Invalid, revoked or disabled API key.")
        return tenant

    def check_invalid_lockout(self, tenant: Tenant) -> None:
        """429 before any parsing while this tenant's requests per minute are used up by invalid requests."""
        until = self._invalid_until.get(tenant.name)
        if until is None:
            return
        left = until - time.monotonic()
        if left <= 0:
            del self._invalid_until[tenant.name]
            return
        gateway_metrics.current().count_rate_limited("requests", tenant.name)
        raise api_errors.invalid_requests_exhausted(max(1, int(left * 1000)))

    async def charge_invalid(self, tenant: Tenant) -> None:
        """A request refused as invalid after authentication costs its tenant one request of its per-minute
        limit (not tokens), so costly parsing cannot be repeated for free; once none is left, the tenant's
        next requests on this gateway get a 429 before they are parsed, until one is
        (`check_invalid_lockout`)."""
        if self.admission is None:
            return
        retry_ms = await self.admission.charge_invalid(tenant)
        if retry_ms > 0:
            if len(self._invalid_until) >= MAX_INVALID_LOCKOUTS:
                self._invalid_until.pop(next(iter(self._invalid_until)))
            self._invalid_until[tenant.name] = time.monotonic() + retry_ms / 1000

    def check_model(self, tenant: Tenant, model: str, prefix: str = "",
                    priority: Priority | None = None) -> Target:
        """The model version serving `model` for this tenant (404, 403 or 503 in OpenAI's shape otherwise)."""
        return self.pools.resolve(model, tenant, prefix, priority)

    async def parse_and_prepare(self, tenant: Tenant, parse: Callable[[], GenerationRequest], size: int,
                                request_id: str,
                                continue_previous: Callable[[Tenant, GenerationRequest], Awaitable[None]],
                                ) -> tuple[GenerationRequest, Prepared]:
        """Parse a body of `size` bytes, continue its stored conversation and prepare it; from
        THREAD_TOKENIZE_BYTES on (long prompts, big JSON schemas to validate) the parse and the preparation
        run off the event loop."""
        if size < THREAD_TOKENIZE_BYTES:
            req = parse()
            await continue_previous(tenant, req)
            return req, self.prepare(tenant, req, request_id)
        req = await run_in_threadpool(parse)
        await continue_previous(tenant, req)
        return req, await run_in_threadpool(self.prepare, tenant, req, request_id)

    def prepare(self, tenant: Tenant, req: GenerationRequest, request_id: str) -> Prepared:
        target = self.check_model(tenant, req.model, sticky_prefix(req),
                                  tenant.effective_priority(req.priority))
        model = target.model
        enc = model.encode(req)
        batch = [enc.ids]
        if req.prompts is not None and len(req.prompts) > 1:
            batch += [model.encode_prompt(pr, f"prompt[{i}]").ids for i, pr in enumerate(req.prompts) if i]
        n_prompt = max(map(len, batch))
        room = model.max_context - n_prompt
        param = "messages" if req.kind == "chat" else "prompt"
        if room <= 0:
            raise invalid(f"This model's maximum context length is {model.max_context} tokens; "
                          f"the prompt has {n_prompt} tokens.", param=param, code="context_length_exceeded")
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = min(tenant.default_max_tokens, tenant.max_tokens, room)
        elif max_tokens > tenant.max_tokens:
            raise invalid(f"max_tokens {max_tokens} is above your limit of {tenant.max_tokens}.",
                          param="max_tokens")
        elif max_tokens > room:
            raise invalid(f"This model's maximum context length is {model.max_context} tokens; you "
                          f"requested {n_prompt + max_tokens} ({n_prompt} in the prompt, {max_tokens} for "
                          f"the completion).", param=param, code="context_length_exceeded")
        ns = namespace_root(target.ns_model, model.version, tenant.salt or tenant.name, target.router.secret)
        prefix = "chatcmpl-" if req.kind == "chat" else "cmpl-"
        shape = ResponseShape(prefix + uuid.uuid4().hex, int(time.time()), target.response_model,
                              req.kind == "chat") \
            if req.api != "responses" else responses_shape.new_shape(target.response_model, req)
        priority = tenant.effective_priority(req.priority)
        return Prepared(request_id, req, tenant, enc.ids, enc.stable_len, max_tokens, priority, ns, shape,
                        batch if len(batch) > 1 else [], target=target,
                        ttft_slo_ms=deadlines.default_target_ms(tenant, priority, self.config.ttft_slo_ms))

    def _target(self, p: Prepared) -> Target:
        return p.target or Target(self.model.model_id, self.model, self.router)

    def _sampling(self, p: Prepared, seed: int | None = None) -> SamplingParams:
        r = p.req
        return SamplingParams(max_tokens=p.max_tokens, temperature=r.temperature, top_p=r.top_p,
                              top_k=r.top_k, seed=r.seed if seed is None else seed, ignore_eos=r.ignore_eos,
                              logprobs=r.logprobs, top_logprobs=r.top_logprobs,
                              presence_penalty=r.presence_penalty, frequency_penalty=r.frequency_penalty,
                              repetition_penalty=r.repetition_penalty,
                              min_tokens=min(r.min_tokens, p.max_tokens), logit_bias=r.logit_bias,
                              grammar=None if r.grammar is None else r.grammar.to_dict(),
                              speculative=r.speculative, cache_retention=r.prompt_cache_retention)

    async def start(self, p: Prepared) -> Generation:
        """Admit the request and open its worker stream; the caller must `close()` the result."""
        stack = AsyncExitStack()
        usage = Usage(prompt_tokens=len(p.prompt_ids))
        target = self._target(p)
        headers: dict[str, str] = {VERSION_HEADER: target.key}
        try:
            ticket = await self._gate(stack, p, usage, headers)
            routed = self._route(target.router, ticket,
                                 self.route_request(p, ttft_deadline=deadlines.worker_deadline(p)))
            stack.callback(target.router.release, routed)  # after the stream closes: a stream never started
            chunks = target.router.stream(routed)
            stack.push_async_callback(_aclose, chunks)
        except BaseException:
            await stack.aclose()
            raise
        return Generation(target.model, p, chunks, stack, usage, headers, self.config.first_token_timeout_s,
                          ticket, tenants=self.tenants)

    def route_request(self, p: Prepared, **extra: Any) -> RouteRequest:
        """What the router gets for `p`'s single stream (`extra`: more RouteRequest fields)."""
        # the response id is unique; a client-chosen x-request-id need not be
        return RouteRequest(
            rid=p.shape.id, ns=p.ns, tokens=p.prompt_ids, cost=len(p.prompt_ids) + p.max_tokens,
            sampling=self._sampling(p), stable_len=p.stable_len, priority=p.priority,
            deadline=time.time() + self.config.request_timeout_s, cache_key=p.req.prompt_cache_key,
            fkey=fairness_key(p.tenant.name, self.router.secret), weight=p.tenant.weight, **extra)

    def choice_route(self, p: Prepared, index: int, **extra: Any) -> RouteRequest:
        """What the router gets for choice `index` of a group (prompt index // n, sibling j = index % n):
        siblings of a prompt share its routing key, so they meet its cached pages on one worker."""
        i, j = divmod(index, p.req.n)
        ids = p.prompts[i]
        return RouteRequest(
            rid=p.shape.id if index == 0 else f"{p.shape.id}-{index}", ns=p.ns, tokens=ids,
            cost=len(ids) + p.max_tokens, sampling=self._sampling(p, sibling_seed(p.req.seed, j)),
            stable_len=p.stable_len if i == 0 else None, priority=p.priority,
            deadline=time.time() + self.config.request_timeout_s, cache_key=p.req.prompt_cache_key,
            fkey=fairness_key(p.tenant.name, self.router.secret), weight=p.tenant.weight,
            **({"ttft_deadline": deadlines.worker_deadline(p)} | extra))

    async def start_group(self, p: Prepared) -> GenerationGroup:
        """Admit once for every choice (prompts once, n x max_tokens each) and open one worker stream per
        choice (`choice_route`)."""
        stack = AsyncExitStack()
        usage = Usage(prompt_tokens=sum(map(len, p.prompts)))
        target = self._target(p)
        headers: dict[str, str] = {VERSION_HEADER: target.key}
        gens: list[Generation] = []
        try:
            ticket = await self._gate(stack, p, usage, headers, p.choices * p.max_tokens)
            for index in range(p.choices):
                routed = self._route(target.router, ticket, self.choice_route(p, index))
                stack.callback(target.router.release, routed)
                chunks = target.router.stream(routed)
                stack.push_async_callback(_aclose, chunks)
                gens.append(Generation(target.model, p, chunks, AsyncExitStack(), usage, headers,
                                       self.config.first_token_timeout_s, ticket, tenants=self.tenants))
        except BaseException:
            await stack.aclose()
            raise
        return GenerationGroup(p, gens, stack, usage, headers)

    @staticmethod
    def _route(router: Router, ticket: AdmissionTicket | None, req: RouteRequest) -> Routed:
        """Choose the request's worker (before its first token is asked for); none usable: 503, nothing
        charged."""
        try:
            return router.route(req)
        except NoWorkerAvailable:
            if ticket is not None:
                ticket.unserved()
            gateway_metrics.current().count_shed("no_worker")
            raise api_errors.no_live_worker() from None

    async def _gate(self, stack: AsyncExitStack, p: Prepared, usage: Usage, headers: dict[str, str],
                    max_tokens: int | None = None) -> AdmissionTicket | None:
        """Shed when no worker is live (before admission: nothing is charged, and capacity would only queue
        then shed), else admit; the ticket's headers go into `headers`."""
        if not self._target(p).router.live():
            gateway_metrics.current().count_shed("no_worker")
            raise api_errors.no_live_worker()
        deadlines.count_target(p)
        if self.admission is None:
            return None
        ticket = await self._admit(stack, p, usage, max_tokens)
        headers.update(ticket.headers)
        return ticket

    async def _admit(self, stack: AsyncExitStack, p: Prepared, usage: Usage,
                     max_tokens: int | None = None) -> AdmissionTicket:
        assert self.admission is not None
        max_tokens = p.max_tokens if max_tokens is None else max_tokens
        step = None
        if self.money is not None:  # held beside the token admission, settled beside it (money_step)
            model = self._target(p).response_model or p.req.model
            step = MoneyStep(self.money, p.tenant.name, p.key_digest, model, p.req.user, usage.prompt_tokens,
                             max_tokens, batch=p.req.batch_line)
            stack.push_async_callback(step.settled)
        try:
            ticket = await stack.enter_async_context(self.admission.admit(
                p.tenant, usage.prompt_tokens, max_tokens, p.priority,
                capacity=self._target(p).capacity, slo=deadlines.slo_target(p)))
        except Exception as exc:
            spec = error_response(exc)
            if spec is None:
                raise
            gateway_metrics.current().admission_refused(exc, p.tenant.name, p.priority.label)
            raise ApiError(spec.status, spec.message, spec.type, code=spec.code,
                           headers=spec.headers) from None
        # Runs before the admission context exits (LIFO), so settle sees the real usage.
        stack.callback(lambda: ticket.record_usage(usage.prompt_tokens, usage.completion_tokens,
                                                   usage.cached_tokens))
        if step is not None:
            hold = p.money_hold = await step.join(ticket)
            stack.callback(step.start_settle, hold, ticket, usage)
        return ticket


def sibling_seed(seed: int | None, j: int) -> int | None:
    """Choice j's seed: the request's own for j = 0 (so n=1 answers match), distinct 64-bit values after."""
    if seed is None or j == 0:
        return seed
    return (seed + j * 0x9E3779B97F4A7C15) % 2**64


async def _aclose(chunks: AsyncIterator[OutItem]) -> None:
    closer: Callable[[], Any] | None = getattr(chunks, "aclose", None)
    if closer is not None:
        await closer()
