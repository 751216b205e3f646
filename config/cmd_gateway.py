"""`switchyard gateway`: build the gateway app from settings and serve it with uvicorn (uvloop).

`build_app` is a gateway process's composition root: tokenizer, tenants, membership and router, admission.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import logging
import os
import socket
import sys

from config.settings import Settings, flags_to_overrides, load_settings

log = logging.getLogger(__name__)

TOP_LEVEL = frozenset({"redis_url", "log_level", "log_format"})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML settings file")
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default 8000)")
    parser.add_argument("--redis-url", dest="redis_url", help="Redis URL (or SWITCHYARD_REDIS_URL)")
    parser.add_argument("--workers", help="comma-separated worker endpoints, e.g. tcp://127.0.0.1:5555; "
                        "without it the Redis worker registry is used")
    parser.add_argument("--model", help="model spec whose tokenizer to use (default: the default model)")
    parser.add_argument("--max-body-bytes", dest="max_body_bytes", type=int, help="request body limit")
    parser.add_argument("--files-dir", dest="files_dir", help="the Files API's directory (shared by the "
                        "replicas; default ~/.cache/switchyard/files; 'off': no /v1/files)")
    parser.add_argument("--body-timeout", dest="body_timeout", type=float,
                        help="seconds for a request's headers, then for its whole body, to arrive "
                        "(late headers: connection closed; late body: 408; default 10)")
    parser.add_argument("--keep-alive-timeout", dest="keep_alive_timeout", type=float,
                        help="seconds an idle keep-alive connection stays open (default 75)")
    parser.add_argument("--stream-write-timeout", dest="stream_write_timeout", type=float,
                        help="seconds a streaming client may take no data before it is cut and its request "
                             "ends (default 30)")
    parser.add_argument("--stream-detach-grace", dest="stream_detach_grace", type=float,
                        help="seconds a stream whose client disconnected runs on for a reconnect with "
                             "Last-Event-ID (default 0: it ends at once; its generated tokens are billed)")
    parser.add_argument("--worker-timeout", dest="worker_timeout", type=float,
                        help="seconds without worker stats before it counts as lost once its link is down "
                             "(default 1)")
    parser.add_argument("--worker-stall-timeout", dest="worker_stall_timeout", type=float,
                        help="seconds without worker stats before it counts as lost while its link still "
                             "answers pings (default 10)")
    parser.add_argument("--route-epsilon", dest="route_epsilon", type=float,
                        help="bounded-load slack: a worker takes new requests below (1 + eps) x mean load "
                             "(default 0.25)")
    parser.add_argument("--route-footprint-epsilon", dest="route_footprint_epsilon", type=float,
                        help="a new prefix goes to a worker holding below (1 + eps) x the mean of placed "
                             "prefix tokens (default 0.1; 0 balances best with one gateway, replicas "
                             "agree less)")
    parser.add_argument("--route-prefix-tokens", dest="route_prefix_tokens", type=int,
                        help="prompt-prefix tokens a routing key covers at most (default 256)")
    parser.add_argument("--model-pools", dest="model_pools", action="store_true", default=None,
                        help="serve every model version the worker registry announces, each with its own "
                             "router and capacity gate; `model` names a version, a model or an alias "
                             "(docs/routing.md)")
    parser.add_argument("--max-resumes", dest="max_resumes", type=int,
                        help="times a stream that lost its worker carries on on another one "
                             "(default 2; 0: never)")
    parser.add_argument("--disagg-min-tokens", dest="disagg_min_tokens", type=int,
                        help="disaggregated prefill: prompt tokens the decode worker lacks at least, for the "
                             "prefill to run on a prefill worker (default 512)")
    parser.add_argument("--disagg-max-prefill-queue", dest="disagg_max_prefill_queue", type=int,
                        help="disaggregated prefill: a prefill worker with more queued, running and "
                             "unacknowledged prefills than this is busy (default 4)")
    parser.add_argument("--log-level", dest="log_level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--log-format", dest="log_format", choices=["json", "text"],
                        help="log lines as JSON objects (default) or text")
    parser.add_argument("--drain-timeout", dest="drain_timeout", type=float,
                        help="on SIGTERM, seconds for in-flight requests to finish before exiting "
                             "(default 30)")
    parser.add_argument("--fail-open", dest="fail_open", action="store_true", default=None,
                        help="Redis unreachable: admit up to this gateway's share of each tenant's limits "
                             "(default: fail closed with 503 quota_service_unavailable)")
    parser.add_argument("--metrics-tenant-labels", dest="metrics_tenant_labels",
                        help="comma-separated tenants that get their own metric label (others: 'other')")


def overrides_from_args(args: argparse.Namespace) -> dict:
    names = ("host", "port", "redis_url", "model", "max_body_bytes", "body_timeout", "keep_alive_timeout",
             "worker_timeout", "worker_stall_timeout", "log_level", "stream_write_timeout", "log_format",
             "drain_timeout", "fail_open", "route_epsilon", "route_footprint_epsilon", "route_prefix_tokens",
             "max_resumes", "model_pools", "disagg_min_tokens", "disagg_max_prefill_queue", "files_dir",
             "stream_detach_grace")
    values = {k: getattr(args, k, None) for k in names}
    if getattr(args, "metrics_tenant_labels", None) is not None:
        values["metrics_tenant_labels"] = [t.strip() for t in args.metrics_tenant_labels.split(",")
                                           if t.strip()]
    if args.workers is not None:
        values["workers"] = [w.strip() for w in args.workers.split(",") if w.strip()]
    return flags_to_overrides(values, "gateway", TOP_LEVEL)


def files_dir(setting: str) -> str | None:
    """The Files API's directory: the setting, ~/.cache/switchyard/files when empty, none when "off"."""
    if setting == "off":
        return None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return setting or os.path.join(base, "switchyard", "files")


def build_app(settings: Settings):
    """The Starlette app of one gateway process (services start in its lifespan)."""
    from admission import Admission, Budget, BudgetGuard, GatewayRegistry, LocalLimiter, MoneyGate
    from gateway.app import AppConfig, create_app
    from gateway.flow.served_model import ServedModel
    from gateway.flow.service import GatewayService, ServiceConfig
    from gateway.responses.response_store import ResponseStore
    from gateway.streams.event_log import EventLogs
    from gateway.telemetry.gateway_metrics import configure as configure_metrics
    from router import Membership, WorkerClient
    from tenancy.directory import TenantDirectory
    from tenancy.redis_client import async_client

    gw = settings.gateway
    if not settings.redis_url:
        raise ValueError("the gateway needs Redis: pass --redis-url or set SWITCHYARD_REDIS_URL")
    redis = async_client(settings.redis_url)
    gateway_id = gw.gateway_id or f"{socket.gethostname()}-{os.getpid()}"

    async def make_service() -> GatewayService:
        model = ServedModel.load(gw.model)
        clients = functools.partial(WorkerClient, inter_token_timeout=gw.inter_token_timeout,
                                    cluster_key=settings.cluster_key())
        if settings.cluster_key() is None:
            log.warning("no cluster key (SWITCHYARD_CLUSTER_SECRET_KEY): worker links are unauthenticated, "
                        "which workers allow on loopback addresses only")
        if gw.model_pools:
            pools = await _start_pools(settings, model, gateway_id, clients, redis)
            router = pools.fleet.router(pools.tokenizers.default.model_id)  # holds the secret; service.close
            gate = None  # closes the pools
        else:
            pools = None
            membership = Membership(gateway_id=gateway_id, static_endpoints=gw.workers,
                                    redis_url=None if gw.workers else settings.redis_url,
                                    dead_after=gw.worker_timeout, stall_after=gw.worker_stall_timeout,
                                    client_factory=clients)
            router = _router(gw, membership, model.version)
            gate = _capacity_gate(gw, router)
            await router.start()
            if gw.kv_event_feeds:
                closers.append(_start_kv_feeds(gw, router, settings.cluster_key()))
        local = None
        if gw.fail_open:
            # Gateways count each other while Redis is up; the last count splits the limits during an outage.
            registry = GatewayRegistry(redis, gateway_id)
            registry.start()
            closers.append(registry.aclose)
            local = LocalLimiter(lambda: registry.live_count)
        budget = Budget(redis, lease_ttl_s=gw.lease_ttl, fail_open=gw.fail_open, local=local)
        admission = Admission(BudgetGuard(budget), gate)
        closers.append(admission.aclose)
        tenants = TenantDirectory(redis, serve_stale_on_error=gw.fail_open)
        service = GatewayService(model, tenants, router, admission,
                                 ServiceConfig(request_timeout_s=gw.request_timeout,
                                               ttft_slo_ms=_ttft_defaults(gw)), pools=pools)
        if gw.money_budgets:  # a hold outlives its request's whole deadline
            service.money = MoneyGate(redis, hold_ttl_s=gw.request_timeout + 60.0)
        # the tokenizer and the rest built at start live as long as the process: out of the collector's sight
        gc.freeze()
        return service

    closers: list = []
    configure_metrics(gw.metrics_tenant_labels)

    async def redis_ok() -> bool:
        return bool(await redis.ping())

    async def close() -> None:
        for closer in closers:
            await closer()
        await redis.aclose()

    return create_app(make_service, AppConfig(max_body_bytes=gw.max_body_bytes,
                                              body_timeout_s=gw.body_timeout,
                                              stream_write_timeout_s=gw.stream_write_timeout,
                                              ready_check=redis_ok, metrics_token=gw.metrics_token,
                                              trace_tenant=gw.trace_tenant,
                                              trust_client_trace=gw.trust_client_trace,
                                              files_dir=files_dir(gw.files_dir),
                                              batch_concurrency=gw.batch_concurrency,
                                              batch_claim_idle_s=gw.batch_claim_idle_s,
                                              event_logs=EventLogs(redis) if gw.stream_resume else None,
                                              stream_detach_grace_s=gw.stream_detach_grace),
                      on_close=close, response_store=ResponseStore(redis), redis=redis)


def _ttft_defaults(gw) -> dict:  # noqa: ANN001
    from common.priorities import Priority

    return {Priority.parse(c): ms for c, ms in gw.ttft_slo_ms.items()}


# settings and router types load late
def _router(gw, membership, tokenizer_version: str):  # noqa: ANN001, ANN202
    from common.priorities import Priority
    from router import DisaggRule, Router

    classes = {Priority.parse(c): label for c, label in gw.class_pools.items()}
    return Router(membership, secret=gw.hash_secret.encode(), route_prefix_tokens=gw.route_prefix_tokens,
                  epsilon=gw.route_epsilon, footprint_epsilon=gw.route_footprint_epsilon,
                  block_size=gw.block_size, tokenizer_version=tokenizer_version, max_resumes=gw.max_resumes,
                  class_pools=classes, disagg=DisaggRule(gw.disagg_min_tokens, gw.disagg_max_prefill_queue))


def _capacity_gate(gw, router):  # noqa: ANN001, ANN202
    from admission import CapacityGate
    from gateway.flow.capacity_view import RouterCapacity

    if not gw.capacity_admission:
        return None
    gate = CapacityGate(RouterCapacity(router), admission_wait_ms=gw.admission_wait_ms,
                        interactive_reserve=gw.interactive_reserve, fair_queue=gw.capacity_fair_queue)
    router.on_stats(lambda _event: gate.notify())  # new stats may make room for waiters
    return gate


async def _start_pools(settings: Settings, model, gateway_id: str, clients, redis):  # noqa: ANN001, ANN202
    """Model pools: the registry's workers split by model version (router.Fleet), aliases from Redis, a
    tokenizer cache and one capacity gate per version; the gateway's own model is a pool from the start."""
    from admission import CapacityGate
    from common.priorities import Priority
    from gateway.flow.capacity_view import RouterCapacity
    from gateway.flow.versions import FleetPools, TokenizerCache
    from router import AliasTable, Fleet, Membership, Served

    gw = settings.gateway
    membership = Membership(gateway_id=gateway_id, static_endpoints=gw.workers, redis_url=settings.redis_url,
                            dead_after=gw.worker_timeout, stall_after=gw.worker_stall_timeout,
                            client_factory=clients)
    own = Served(model.model_id, "", model.version, "")
    fleet = Fleet(membership, lambda view, served: _router(gw, view, served.tokenizer or model.version),
                  default=own)
    fleet.pool(own)

    def make_gate(router, pool: str | None) -> CapacityGate | None:  # noqa: ANN001
        if not gw.capacity_admission:
            return None
        gate = CapacityGate(RouterCapacity(router, pool), admission_wait_ms=gw.admission_wait_ms,
                            interactive_reserve=gw.interactive_reserve, fair_queue=gw.capacity_fair_queue)
        return gate

    aliases = AliasTable(redis, poll_s=gw.alias_poll_s)
    classes = {Priority.parse(c): label for c, label in gw.class_pools.items()}
    pools = FleetPools(fleet, TokenizerCache(model, gw.model), aliases, make_gate, classes)
    fleet.on_stats(lambda _event: pools.notify())
    loop = asyncio.get_running_loop()  # a new version's tokenizer loads on a thread, not in its first request
    fleet.on_version(lambda key: loop.run_in_executor(None, pools.tokenizers.get, fleet.served(key)))
    await aliases.start()
    await fleet.start()
    return pools


# set by `make run` (config.local_stack.launcher): the default secret is fine there
DEV_STACK_ENV = "SWITCHYARD_DEV_STACK"


def warn_default_secret(secret: str) -> None:
    """Loudly warn when the prefix-hash secret is the public default outside `make run`."""
    from config.settings import GatewaySettings

    if secret == GatewaySettings.model_fields["hash_secret"].default and not os.environ.get(DEV_STACK_ENV):
        import logging

        logging.getLogger("switchyard.gateway").warning(
            "SECURITY: gateway.hash_secret is the public default %r: anyone can compute this deployment's "
            "prefix-cache routing keys. Set SWITCHYARD_GATEWAY__HASH_SECRET (or hash_secret in the config "
            "file) to a random per-deployment value.", secret)


def run(args: argparse.Namespace) -> int:
    from config.logs import configure_logging
    from gateway.telemetry.request_log import RequestIdFilter
    from gateway.web.drain_middleware import serve
    from gateway.web.header_deadline import header_deadline_protocol

    try:
        settings = load_settings(args.config, overrides_from_args(args))
        app = build_app(settings)
    except (ValueError, FileNotFoundError) as exc:
        print(f"switchyard gateway: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format, [RequestIdFilter()])
    from common.otel_setup import install_tracing

    install_tracing("switchyard-gateway", settings.otel_endpoint)
    gw = settings.gateway
    warn_default_secret(gw.hash_secret)
    # SIGTERM: lame-duck for drain_timeout (gateway.web.drain_middleware), then a short window before
    # stragglers are cancelled
    from gateway.web.auth_gate import UnknownKeyGate

    # unknown keys are answered in front of the Starlette stack (an unknown-key flood stays cheap)
    return serve(UnknownKeyGate(app), app.state.drain, gw.drain_timeout, host=gw.host, port=gw.port,
                 loop="uvloop", http=header_deadline_protocol(gw.body_timeout),
                 log_level=settings.log_level.lower(), access_log=False, log_config=None,
                 timeout_keep_alive=gw.keep_alive_timeout, timeout_graceful_shutdown=2)


def _start_kv_feeds(gw, router, cluster_key: str | None):  # noqa: ANN001, ANN202
    """Subscribe the router to the configured KV event publishers; the closer stops the subscriptions."""
    from router import FeedSource, KvFeeds

    feeds = KvFeeds([FeedSource(**f.model_dump()) for f in gw.kv_event_feeds], router.kv.index,
                    gw.block_size, cluster_key)
    task = asyncio.create_task(feeds.run(), name="kv event feeds")

    async def stop() -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        feeds.close()

    return stop
