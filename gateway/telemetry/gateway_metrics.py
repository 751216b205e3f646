"""The gateway's Prometheus metrics and access log (names: a contract with `docker/grafana-dashboard.json`).

Tenant labels are limited to the configured tenants (the rest are "other"), so label sets stay bounded.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
)
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from admission import Overloaded, QuotaExceeded, TtftUnattainable
from tenancy import QuotaServiceUnavailable

log = logging.getLogger("switchyard.gateway.access")

OTHER_TENANT = "other"
API_PREFIX = "/v1/"
SHED_REASONS = ("capacity", "ttft_slo", "no_worker", "draining", "quota_service_unavailable")
SLO_OUTCOMES = ("target", "met", "missed", "shed")  # requests with a TTFT target, then how each ended
RATE_LIMIT_REASONS = ("requests", "tokens", "concurrency")

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class GatewayMetrics:
    def __init__(self, tenant_labels: Sequence[str] = (), registry: CollectorRegistry = REGISTRY) -> None:
        self.labelled_tenants = frozenset(tenant_labels)
        self.registry = registry
        per_req = ["priority", "tenant"] if self.labelled_tenants else ["priority"]
        tok = ["tenant"] if self.labelled_tenants else []

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, per_req, buckets=buckets, registry=registry)

        def counter(name: str, doc: str, labels: list[str]) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        self.ttft = hist("switchyard_ttft_seconds", "Time to first token of streamed requests", TTFT_BUCKETS)
        self.inter_token = hist("switchyard_inter_token_seconds",
                                "Gap between streamed tokens (per SSE chunk, divided by its tokens)",
                                ITL_BUCKETS)
        self.e2e = hist("switchyard_e2e_seconds", "Request latency, arrival to last token", E2E_BUCKETS)
        self.queue = hist("switchyard_queue_seconds", "Admission wait (budget and capacity)", QUEUE_BUCKETS)
        self.requests = counter("switchyard_requests", "API responses by HTTP status", ["status"])
        self.prompt_tokens = counter("switchyard_prompt_tokens", "Prompt tokens of served requests", tok)
        self.completion_tokens = counter("switchyard_completion_tokens", "Generated tokens", tok)
        self.cached_tokens = counter("switchyard_cached_tokens",
                                     "Prompt tokens served from a prefix cache", tok)
        self.rate_limited = counter("switchyard_rate_limited", "429s by the tenant limit hit",
                                    ["reason", *tok])
        self.shed = counter("switchyard_shed",
                            "503s by reason (our capacity, not the tenant's quota)", ["reason"])
        # A stream that fails after its 200 headers ends with an SSE error event; `requests` still says 200.
        self.stream_errors = counter("switchyard_stream_errors",
                                     "Streams ended by an SSE error event after a 200, by error status",
                                     ["status"])
        # resumable streams (gateway.streams): replays by how they ended; streams no longer logged
        # (Redis behind)
        self.stream_resumes = counter("switchyard_stream_resumes",
                                      "Reconnected streams by how the replay ended "
                                      "(done, cut, lost, timeout)", ["outcome"])
        self.stream_log_dropped = counter("switchyard_stream_log_dropped",
                                          "Streams no longer logged: too many events waited for Redis", [])
        # per model version (a canary is judged by these); versions are bounded (router.fleet.MAX_VERSIONS)
        self.version_ttft = Histogram("switchyard_version_ttft_seconds",
                                      "Time to first token by model version", ["version"],
                                      buckets=TTFT_BUCKETS, registry=registry)
        self.version_requests = counter("switchyard_version_requests",
                                        "Generations by model version and outcome (ok, error)",
                                        ["version", "outcome"])
        self.version_tokens = counter("switchyard_version_tokens",
                                      "Tokens by model version and kind (prompt, completion)",
                                      ["version", "kind"])
        # SLO attainment = met / (met + missed); shed: refused at admission as unattainable
        self.ttft_slo = counter("switchyard_ttft_slo",
                                "Requests with a TTFT target by outcome (target, met, missed, shed)",
                                ["outcome", *per_req])
        self._collectors = (self.ttft_slo, self.ttft, self.inter_token, self.e2e, self.queue, self.requests,
                            self.prompt_tokens, self.completion_tokens, self.cached_tokens, self.rate_limited,
                            self.shed, self.stream_errors, self.stream_resumes, self.stream_log_dropped,
                            self.version_ttft, self.version_requests, self.version_tokens)
        for reason in SHED_REASONS:  # every reason is exported from the start, at 0
            self.shed.labels(reason)
        for reason in RATE_LIMIT_REASONS:
            for tenant in sorted(self.labelled_tenants | {OTHER_TENANT}) if self.labelled_tenants else [None]:
                self.rate_limited.labels(reason, *([tenant] if tenant else []))

    def tenant_label(self, tenant: str) -> str:
        return tenant if tenant in self.labelled_tenants else OTHER_TENANT

    def _tok(self, tenant: str) -> tuple[str, ...]:
        return (self.tenant_label(tenant),) if self.labelled_tenants else ()

    def trace(self, priority: str, tenant: str, start: float, version: str = "") -> RequestTrace:
        """A new request's latency recorder; `start` is its arrival (`time.perf_counter()`); `version`: the
        model version serving it ("": no per-version metrics)."""
        return RequestTrace(self, (priority, *self._tok(tenant)), self._tok(tenant), start,
                            time.perf_counter(), version=version)

    def count_shed(self, reason: str) -> None:
        self.shed.labels(reason).inc()

    def count_rate_limited(self, reason: str, tenant: str) -> None:
        self.rate_limited.labels(reason, *self._tok(tenant)).inc()

    def count_slo(self, outcome: str, priority: str, tenant: str) -> None:
        self.ttft_slo.labels(outcome, priority, *self._tok(tenant)).inc()

    def admission_refused(self, exc: BaseException, tenant: str, priority: str = "interactive") -> None:
        """Count an admission exception as rate-limited or shed (others are not refusals)."""
        if isinstance(exc, QuotaExceeded):
            self.count_rate_limited(exc.result.limit_name or "requests", tenant)
        elif isinstance(exc, TtftUnattainable):
            self.count_shed("ttft_slo")
            self.count_slo("shed", priority, tenant)
        elif isinstance(exc, Overloaded):
            self.count_shed("capacity")
        elif isinstance(exc, QuotaServiceUnavailable):
            self.count_shed("quota_service_unavailable")

    def unregister(self) -> None:
        for collector in self._collectors:
            self.registry.unregister(collector)


@dataclass(slots=True)
class RequestTrace:
    """Latencies and usage of one generation; every method is called at most once per event."""

    metrics: GatewayMetrics
    labels: tuple[str, ...]  # (priority[, tenant])
    token_labels: tuple[str, ...]  # ([tenant])
    start: float
    admit_start: float
    last: float = 0.0
    tokens: int = 0
    version: str = ""
    _itl: Any = field(default=None)

    def admitted(self) -> None:
        self.metrics.queue.labels(*self.labels).observe(time.perf_counter() - self.admit_start)

    def first_token(self, completion_tokens: int) -> None:
        now = time.perf_counter()
        self.metrics.ttft.labels(*self.labels).observe(now - self.start)
        if self.version:
            self.metrics.version_ttft.labels(self.version).observe(now - self.start)
        self._itl = self.metrics.inter_token.labels(*self.labels)
        self.last, self.tokens = now, completion_tokens

    def next_chunk(self, completion_tokens: int) -> None:
        """A later streamed chunk: one observation of the mean gap of the tokens it carries."""
        n = completion_tokens - self.tokens
        if n <= 0 or self._itl is None:
            return
        now = time.perf_counter()
        self._itl.observe((now - self.last) / n)
        self.last, self.tokens = now, completion_tokens

    def refused(self) -> None:
        """The request never started (admission or routing refused it): an error of its version."""
        if self.version:
            self.metrics.version_requests.labels(self.version, "error").inc()

    def finished(self, prompt: int, completion: int, cached: int, completed: bool) -> None:
        """The generation is closed; tokens count when a worker produced anything."""
        m = self.metrics
        if completed:
            m.e2e.labels(*self.labels).observe(time.perf_counter() - self.start)
        if completed or completion > 0:
            for counter, n in ((m.prompt_tokens, prompt), (m.completion_tokens, completion),
                               (m.cached_tokens, cached)):
                (counter.labels(*self.token_labels) if self.token_labels else counter).inc(n)
        if self.version:
            m.version_requests.labels(self.version, "ok" if completed else "error").inc()
            m.version_tokens.labels(self.version, "prompt").inc(prompt)
            m.version_tokens.labels(self.version, "completion").inc(completion)


_CURRENT: GatewayMetrics | None = None


def configure(tenant_labels: Sequence[str] = ()) -> GatewayMetrics:
    """The process-wide metrics, (re)made when the tenant label set changes."""
    global _CURRENT
    if _CURRENT is not None and _CURRENT.labelled_tenants == frozenset(tenant_labels):
        return _CURRENT
    if _CURRENT is not None:
        _CURRENT.unregister()
    _CURRENT = GatewayMetrics(tenant_labels)
    return _CURRENT


def current() -> GatewayMetrics:
    return _CURRENT if _CURRENT is not None else configure()


@dataclass(slots=True)
class UnauthenticatedLines:
    """At most `per_second` access lines a second for 401s (an unknown-key flood must not become a log flood);
    the rest are counted and summed up in one line when the next second starts. The metric counts all."""

    per_second: int = 10
    window: int = 0
    logged: int = 0
    suppressed: int = 0

    def admit(self, now: float) -> bool:
        second = int(now)
        if second != self.window:
            if self.suppressed:
                log.warning("%d more unauthenticated requests (401) were not logged", self.suppressed,
                            extra={"status": 401, "suppressed": self.suppressed})
            self.window, self.logged, self.suppressed = second, 0, 0
        if self.logged < self.per_second:
            self.logged += 1
            return True
        self.suppressed += 1
        return False


class ObserveMiddleware:
    """Counts `/v1/` responses by status; one access line per API request (401s: `UnauthenticatedLines`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.unauthenticated = UnauthenticatedLines()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(API_PREFIX):
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # an exception that escapes before any response

        async def send_observed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_observed)
        finally:
            current().requests.labels(str(status)).inc()
            if status != 401 or self.unauthenticated.admit(time.monotonic()):
                log.info("%s %s %d", scope["method"], scope["path"], status,
                         extra={"status": status,
                                "duration_ms": round((time.perf_counter() - start) * 1000, 1)})


def exposition() -> tuple[bytes, str]:
    """The metrics page: this process's registry, or every process's in multiprocess mode."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(current().registry), CONTENT_TYPE_LATEST


async def metrics_endpoint(request: Request) -> Response:
    body, content_type = exposition()
    return Response(body, media_type=None, headers={"content-type": content_type})


_LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})
_PROXY_HEADERS = ("forwarded", "x-forwarded-for", "x-real-ip")  # an HTTP proxy passed the request on


def guarded_endpoint(token: str | None):
    """/metrics with `Authorization: Bearer <token>` (compared as SHA-256 digests in constant time) from
    anyone when a token is set, loopback included; without a token, for loopback clients whose request names
    no proxy. Anyone else gets a plain 404, as for a path that does not exist. Behind a same-host TCP proxy
    (which adds no header) set the token: the proxy makes every client loopback."""
    want = hashlib.sha256(token.encode()).digest() if token else None

    async def endpoint(request: Request) -> Response:
        if want is None:
            client = request.client.host if request.client else ""
            ok = client in _LOOPBACK and not any(h in request.headers for h in _PROXY_HEADERS)
        else:
            header = request.headers.get("authorization", "")
            given = header[7:].strip() if header[:7].lower() == "bearer " else ""
            ok = hmac.compare_digest(hashlib.sha256(given.encode()).digest(), want)
        if not ok:
            return Response("Not Found", status_code=404, media_type="text/plain")
        return await metrics_endpoint(request)

    return endpoint
