"""One typed settings model for every Switchyard process, with a section per component.

Precedence: CLI flags, `SWITCHYARD_*` environment variables, the `--config` TOML file, then defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)


class WorkerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = "default"  # "default", "tiny-random" or a local HF folder / GGUF path
    # the engine behind the worker protocol: Switchyard's own, or vLLM's (an HF folder; docs/vllm-engine.md)
    engine: Literal["switchyard", "vllm"] = "switchyard"
    engine_args: str = Field("", max_length=8192)  # vLLM's own engine flags, one shell-quoted string
    bind: str = "tcp://127.0.0.1:5555"
    advertise: str | None = None  # endpoint gateways connect to; default: the bound one
    worker_id: str | None = None  # default: <hostname>-<port>
    # model pools: the version label and traffic-class pool label this worker announces in its registration
    model_version: str = Field("", max_length=64, pattern=r"^[A-Za-z0-9_.-]*$")
    pool: str = Field("", max_length=64, pattern=r"^[A-Za-z0-9_.-]*$")
    # disaggregated prefill (docs/disaggregation.md): both serves gateways and prefills itself; prefill only
    # prefills for decode workers; decode serves gateways and takes pages from prefill workers when told to
    role: Literal["both", "prefill", "decode"] = "both"
    disagg_stall_s: float = Field(5.0, gt=0)  # no pages from the prefill worker for this long: prefill here
    disagg_lease_s: float = Field(60.0, gt=0)  # a whole transfer's bound (the leased pages free after it)
    drain_timeout: float = Field(30.0, gt=0)
    # SIGTERM: after this many seconds running streams are handed over (the gateways resume them on other
    # workers); negative: never (a single-worker deployment: they finish here within drain_timeout)
    drain_handoff: float = 1.0
    gateway_timeout: float = Field(5.0, gt=0)
    stats_interval: float = Field(0.1, gt=0)
    # engine knobs (worker.config.EngineConfig); None keeps the engine's default
    block_size: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    kv_cache_bytes: int | None = None
    dtype: Literal["auto", "bfloat16", "float32", "float16"] = "auto"
    device: str = "auto"
    enable_prefix_cache: bool = True
    # between tenants within a priority class: VTC fair share or arrival
    fairness: Literal["vtc", "fifo"] = "vtc"
    # VTC, worker shared: prefill tokens per step cap (0: none)
    fair_step_tokens: int | None = Field(None, ge=0)
    prefill_step_tokens: int | None = Field(None, ge=0)
    num_threads: int | None = None
    # weights; auto: worker.quant.resolve_mode (every way of starting a worker has this default: make run,
    # switchyard worker, compose, the Kubernetes manifests)
    quantization: Literal["none", "int8", "int4", "w8a8", "fp8", "auto"] = "auto"
    # attention backend (worker.model.backends.choose_backend); None keeps the engine's default (auto)
    attention: Literal["auto", "triton", "flash_attn", "torch", "torch_reference"] | None = None
    # KV cache pages (worker.model.kv_dtype; auto: the model dtype, int8 is asked for);
    # fp8 is refused at startup with the reason
    kv_dtype: Literal["auto", "model", "int8", "fp8"] = "auto"
    # KV tiers below the prefix cache (worker.kvcache.tiers); None keeps the engine's default (host RAM: auto)
    kv_host_bytes: int | None = Field(None, ge=0)
    kv_disk_dir: str | None = None
    kv_disk_bytes: int | None = Field(None, gt=0)
    kv_disk_min_hits: int | None = Field(None, ge=0)
    # decode CUDA graphs (CUDA only); None keeps the default (on)
    cuda_graphs: Literal["on", "off"] | None = None
    # worker.kernels.layer_ops; None keeps the engine's default (on)
    fused_ops: Literal["on", "off"] | None = None
    # decode steps' norms and SiLU-mul inside the projections (CUDA; worker.kernels.triton_gemv); None keeps
    # the engine's default (auto)
    fused_linear: Literal["auto", "on", "off"] | None = None
    # n-gram speculative decoding (worker.engine.scheduling.speculative); None keeps the engine's default
    spec_tokens: int | None = Field(None, ge=0, le=16)
    spec_max_batch: int | None = Field(None, ge=0)
    spec_ngram_max: int | None = Field(None, ge=1, le=8)
    spec_ngram_min: int | None = Field(None, ge=1, le=8)
    # vLLM-format KV events (docs/routing.md "KV events in vLLM's format"): PUB and replay endpoints (None:
    # off), the topic (None: kv@<worker_id>@<model>), and plain: no CurveZMQ on them even with a cluster key
    kv_events_endpoint: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str | None = Field(None, max_length=256)
    kv_events_plain: bool = False
    metrics_port: int = Field(0, ge=0, le=65535)  # Prometheus /metrics HTTP port; 0 = disabled
    # an operator opens it wider on purpose (Kubernetes: 0.0.0.0 in workers.yaml)
    metrics_host: str = "127.0.0.1"


class KvEventFeed(BaseModel):
    """A publisher of KV events in vLLM's format the router indexes (docs/routing.md)."""

    model_config = ConfigDict(extra="forbid")
    worker_id: str = Field(min_length=1)  # the worker id its blocks count for
    endpoint: str = Field(pattern=r"^(tcp|ipc)://")  # its PUB socket
    replay_endpoint: str | None = Field(None, pattern=r"^(tcp|ipc)://")  # its replay socket
    hashes: Literal["vllm", "switchyard"] = "vllm"  # switchyard: the hashes are Switchyard block ids
    topic: str = ""  # subscription prefix


class GatewaySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    workers: list[str] = Field(default_factory=list)  # static worker endpoints; empty => Redis registry
    gateway_id: str | None = None  # default: <hostname>-<pid>
    inter_token_timeout: float = Field(30.0, gt=0)
    worker_timeout: float = Field(1.0, gt=0)  # no stats for this long, link down => worker lost
    # no stats for this long while the link still answers ZMTP pings (a busy worker loop) => worker lost
    worker_stall_timeout: float = Field(10.0, gt=0)
    model: str = "default"  # tokenizer/model spec the gateway serves (same as the workers')
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0)  # larger request bodies get 413
    body_timeout: float = Field(10.0, gt=0)  # seconds for a request's headers, then its body, to arrive
    # an idle keep-alive connection stays open this long: longer than clients' pool expiry (httpx, so the
    # OpenAI SDK: 5 s) and load balancers' idle timeouts (often 60 s), so a reused connection never races the
    # server's close (uvicorn's own default, 5 s, equals httpx's and lost requests to that race)
    keep_alive_timeout: float = Field(75.0, gt=0)
    request_timeout: float = Field(600.0, gt=0)  # whole-request deadline sent to the worker
    stream_write_timeout: float = Field(30.0, gt=0)  # an SSE client that takes no chunk for this long is cut
    # /metrics on the public port: with a token, only `Authorization: Bearer <this>` (loopback included: a
    # proxy on the same host makes every client loopback); without one, loopback clients whose request came
    # through no HTTP proxy. It shows worker ids and, with tenant labels, per-tenant volumes
    metrics_token: str | None = None
    hash_secret: str = "switchyard-dev-secret"  # per-deployment key of prefix hashes; set it in production
    # bounded loads: a worker takes new keys below (1 + eps) x mean
    route_epsilon: float = Field(0.25, ge=0.0)
    # a prefix no worker holds goes to a worker whose placed prefix tokens are below (1 + eps) x mean
    route_footprint_epsilon: float = Field(0.1, ge=0.0)
    route_prefix_tokens: int = Field(256, ge=0)  # stable-prefix tokens a routing key covers at most
    # a stream whose worker is lost (or drains) after tokens were streamed carries on on another worker, with
    # the prompt and the streamed tokens, at most this many times (router.dispatch; 0: never)
    max_resumes: int = Field(2, ge=0, le=16)
    # the workers' KV block size: the unit of block hashes; a worker reporting another size is refused
    block_size: int = Field(16, gt=0)
    # capacity admission (admission.capacity.CapacityGate over the workers' KV stats)
    capacity_admission: bool = True
    admission_wait_ms: int = Field(2000, ge=0)  # queue this long for KV capacity, then 503 server_overloaded
    interactive_reserve: float = Field(0.2, ge=0.0, lt=1.0)  # share of each worker's KV kept for interactive
    capacity_fair_queue: bool = True  # capacity waiters: fair across tenants (false: one FIFO per priority)
    # priority class -> default time-to-first-token target (ms) of requests whose tenant sets none; 0: none
    ttft_slo_ms: dict[Literal["interactive", "batch"], int] = Field(
        default_factory=lambda: {"interactive": 0, "batch": 0})
    fail_open: bool = False  # Redis down: admit up to this gateway's share of each limit instead of 503
    lease_ttl: float = Field(60.0, gt=0)  # concurrency lease expiry (renewed every ttl/3 while streaming)
    money_budgets: bool = False  # dollar budgets per organization/project/key/user (admission/money)
    drain_timeout: float = Field(30.0, gt=0)  # SIGTERM: seconds for in-flight requests to finish
    # tenants with their own `tenant` metric label (the rest are "other"); empty = no tenant label
    metrics_tenant_labels: list[str] = Field(default_factory=list, max_length=100)
    trace_tenant: bool = False  # request spans carry the tenant's name (never keys or prompt text)
    # a client's `traceparent` parents the request span only when trusted (clients inside the operator's own
    # tracing); otherwise the span starts its own trace and links to the client's span
    trust_client_trace: bool = False
    # the Files API's directory (gateway.files): one volume shared by the replicas in compose and Kubernetes;
    # empty: ~/.cache/switchyard/files, "off": no /v1/files
    files_dir: str = ""
    batch_concurrency: int = Field(4, ge=1, le=256)  # batch lines one gateway runs at once (docs/batches.md)
    # a batch line claimed this long ago and not answered is taken over by another gateway (a dead claimer's)
    batch_claim_idle_s: float = Field(60.0, ge=1.0, le=3600.0)
    # resumable streams (gateway.streams): SSE event ids, a Redis event log per stream, replay on any replica
    stream_resume: bool = True
    # a stream whose client left runs on this long for a reconnect (0: a client that leaves ends its stream)
    stream_detach_grace: float = Field(0.0, ge=0)
    # model pools (docs/routing.md): registry workers grouped by model version, each with its own router and
    # capacity gate; `model` picks a version directly, by model name or a weighted alias (Redis `sy:aliases`)
    model_pools: bool = False
    alias_poll_s: float = Field(0.5, gt=0, le=1.0)  # alias edits apply within this (plus one Redis read)
    # priority class -> preferred worker pool label; a request spills to other pools under the load bound
    class_pools: dict[Literal["interactive", "batch"], str] = Field(
        default_factory=lambda: {"interactive": "interactive", "batch": "batch"})
    # disaggregated prefill (docs/routing.md): a request's prefill runs on a prefill-role worker when its
    # decode worker lacks at least disagg_min_tokens of the prompt and a prefill worker has at most
    # disagg_max_prefill_queue prefills queued, running or sent by this gateway and not yet acknowledged
    disagg_min_tokens: int = Field(512, ge=1)
    disagg_max_prefill_queue: int = Field(4, ge=0)
    # KV events in vLLM's format (vLLM servers or Switchyard workers with --kv-events-endpoint) into the
    # router's view of which worker holds which blocks
    kv_event_feeds: list[KvEventFeed] = Field(default_factory=list, max_length=256)

    @field_validator("ttft_slo_ms")
    @classmethod
    def _check_ttft(cls, value: dict[str, int]) -> dict[str, int]:
        if any(ms < 0 for ms in value.values()):
            raise ValueError("ttft_slo_ms values must be >= 0 (0: no target)")
        return value


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SWITCHYARD_", env_nested_delimiter="__", extra="forbid",
                                      hide_input_in_errors=True)  # no secret in an error message

    redis_url: str | None = None
    # z85 CURVE secret key shared by workers and gateways (env SWITCHYARD_CLUSTER_SECRET_KEY); never logged
    cluster_secret_key: SecretStr | None = None
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["json", "text"] = "json"
    # OTLP/HTTP traces endpoint (e.g. http://collector:4318/v1/traces; needs the `otel` extra); None: off
    otel_endpoint: str | None = None
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)

    @field_validator("cluster_secret_key", mode="before")
    @classmethod
    def _check_cluster_key(cls, value: Any) -> Any:
        """An empty value means none; anything else must be a z85 CURVE secret key."""
        raw = value.get_secret_value() if isinstance(value, SecretStr) else value
        if raw is None or raw == "":
            return None
        import zmq

        try:
            zmq.curve_public(str(raw).encode())
        except (zmq.ZMQError, ValueError):
            raise ValueError("cluster_secret_key must be a z85 CURVE secret key of 40 characters "
                             "(python -c 'import zmq; print(zmq.curve_keypair()[1].decode())')") from None
        return value

    def cluster_key(self) -> str | None:
        """The cluster secret key as text, or None (unauthenticated worker links, loopback only)."""
        return None if self.cluster_secret_key is None else self.cluster_secret_key.get_secret_value()


def load_settings(config_file: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Settings:
    """Build Settings from overrides (CLI) > environment > TOML file > defaults.

    Raises FileNotFoundError for a missing config file and pydantic.ValidationError for bad values.
    """
    toml_path = Path(config_file) if config_file is not None else None
    if toml_path is not None and not toml_path.is_file():
        raise FileNotFoundError(f"config file not found: {toml_path}")

    class _Settings(Settings):
        @classmethod
        def settings_customise_sources(
            cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
            if toml_path is not None:
                sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_path))
            return tuple(sources)

    return _Settings(**(overrides or {}))


def flags_to_overrides(values: dict[str, Any], section: str, top_level: frozenset[str]) -> dict[str, Any]:
    """Turn argparse values into a nested overrides dict, keeping only flags that were given (not None)."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        if value is None:
            continue
        if name in top_level:
            out[name] = value
        else:
            out.setdefault(section, {})[name] = value
    return out
