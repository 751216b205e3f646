"""`switchyard worker`: load a model, build the engine, and serve it over ZeroMQ until drained.

Torch and the model load only when the command runs.
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Any

from config.settings import Settings, WorkerSettings, flags_to_overrides, load_settings

_TOP_LEVEL = frozenset({"redis_url", "log_level", "log_format"})
_ENGINE_FIELDS = ("block_size", "max_num_batched_tokens", "max_num_seqs", "kv_cache_bytes", "num_threads",
                  "fairness", "fair_step_tokens", "prefill_step_tokens", "spec_tokens", "spec_ngram_max",
                  "spec_ngram_min",
                  "spec_max_batch", "fused_ops", "fused_linear", "attention", "cuda_graphs", "kv_dtype",
                  "kv_host_bytes", "kv_disk_dir", "kv_disk_bytes", "kv_disk_min_hits")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--config", help="TOML settings file (top-level keys and a [worker] table)")
    a("--model", help="'default', 'tiny-random', a .gguf file or a local HF folder")
    a("--engine", choices=["switchyard", "vllm"],
      help="the engine behind the worker protocol: switchyard (default) or vllm (vLLM's engine in process, "
           "for an HF folder: pip install switchyard[vllm]; docs/vllm-engine.md)")
    a("--engine-args", help="--engine vllm: vLLM's own engine flags as one string, e.g. "
                            "'--tensor-parallel-size 2 --max-model-len 8192'")
    a("--bind", help="ZeroMQ endpoint to bind, e.g. tcp://127.0.0.1:5555")
    a("--advertise", help="endpoint gateways should connect to (default: the bound one)")
    a("--worker-id", help="registry id (default: <hostname>-<port>)")
    a("--model-version", help="version label announced in the registry (model pools: <model>@<version>)")
    a("--pool", help="traffic-class pool label announced in the registry, e.g. interactive or batch")
    a("--role", choices=["both", "prefill", "decode"],
      help="disaggregated prefill: both (default), prefill (prefills for decode workers only) or decode")
    a("--disagg-stall-s", type=float,
      help="seconds without pages from a prefill worker before prefilling here")
    a("--disagg-lease-s", type=float, help="bound of one whole page transfer from a prefill worker")
    a("--redis-url", help="register in this Redis (env SWITCHYARD_REDIS_URL)")
    a("--drain-timeout", type=float, help="seconds to finish running requests after SIGTERM")
    a("--drain-handoff", type=float,
      help="seconds into a drain to hand running streams to other workers (default 1; negative: never)")
    a("--gateway-timeout", type=float, help="abort a gateway's requests after this many silent seconds")
    a("--stats-interval", type=float, help="seconds between stats frames")
    a("--block-size", type=int)
    a("--max-num-batched-tokens", type=int)
    a("--max-num-seqs", type=int)
    a("--kv-cache-bytes", type=int, help="KV cache budget on CPU")
    a("--num-threads", type=int, help="torch intra-op threads")
    a("--dtype", choices=["auto", "bfloat16", "float32", "float16"])
    a("--device", help="auto, cpu, cuda or cuda:N")
    a("--quantization", choices=["none", "int8", "int4", "w8a8", "fp8", "auto"],
      help="weight quantization; w8a8 also quantizes prefill activations; fp8 needs CUDA compute capability "
           "8.9+ (auto: none, since every 8-bit mode changes greedy answers; w8a8 with --kv-dtype int8 is "
           "the CPU speed profile: docs/cpu-performance.md)")
    a("--attention", choices=["auto", "triton", "flash_attn", "torch", "torch_reference"],
      help="attention backend (auto: flash_attn on CUDA where installed and the page size fits, else triton "
           "on CUDA; torch on CPU)")
    a("--kv-dtype", choices=["auto", "model", "int8", "fp8"],
      help="KV cache pages: model (the model's dtype), int8 (8-bit with per page and head scales: ~2x the "
           "tokens per byte) or auto (default: model); fp8 is refused")
    a("--kv-host-bytes", type=int,
      help="KV tier in host RAM for pages the prefix cache evicts (default: 1/8 of available memory; 0: off)")
    a("--kv-disk-dir", help="KV tier on disk under this directory (default: none)")
    a("--kv-disk-bytes", type=int, help="size bound of the disk tier (default 16 GiB)")
    a("--kv-disk-min-hits", type=int,
      help="prefix-cache hits a page needs before it may go to disk (default 1)")
    a("--cuda-graphs", choices=["on", "off"],
      help="replay decode steps as CUDA graphs (CUDA only; default on)")
    a("--no-prefix-cache", dest="enable_prefix_cache", action="store_const", const=False, default=None)
    a("--fused-ops", choices=["on", "off"],
      help="a layer's norms, SiLU-mul and RoPE as fused C++ passes on CPU (default on; off: eager torch "
           "reference)")
    a("--fused-linear", choices=["auto", "on", "off"],
      help="CUDA decode steps of up to 64 rows: add + RMSNorm inside qkv and gate/up, SiLU-mul inside down "
           "(Triton; default auto, which is off until measured on a device)")
    a("--fairness", choices=["vtc", "fifo"], help="order between tenants in a priority class (default vtc)")
    a("--fair-step-tokens", type=int,
      help="VTC: cap a step's prefill tokens while the worker serves several tenants (0: no cap)")
    a("--prefill-step-tokens", type=int,
      help="a step carrying a prefill takes another request's only within this many prefill tokens, so a "
           "burst's first tokens come one after another (default: 64 on CPU, none on CUDA; 0: no cap)")
    a("--spec-tokens", type=int, help="n-gram speculative decoding: drafts per sequence per step (0: off)")
    a("--spec-max-batch", type=int, help="speculate only while this many sequences decode or fewer (0: off)")
    a("--spec-ngram-max", type=int, help="longest suffix matched for drafts (default 3)")
    a("--spec-ngram-min", type=int, help="shortest suffix matched for drafts (default 1)")
    a("--kv-events-endpoint",
      help="publish the prefix cache's block changes as vLLM KV events on this ZeroMQ PUB endpoint, e.g. "
           "tcp://*:5557 (default: off)")
    a("--kv-events-replay", help="ROUTER endpoint answering vLLM replay requests, e.g. tcp://*:5558")
    a("--kv-events-topic", help="topic of the KV event messages (default kv@<worker_id>@<model>)")
    a("--kv-events-plain", action="store_const", const=True, default=None,
      help="no CurveZMQ on the KV event sockets even with a cluster key (subscribers such as llm-d's)")
    a("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    a("--log-format", choices=["json", "text"], help="log lines as JSON objects (default) or text")
    a("--metrics-port", type=int, help="serve Prometheus /metrics on this port (default 0: off)")
    a("--metrics-host", help="address of the metrics port (default 0.0.0.0)")


def settings_from_args(args: argparse.Namespace) -> Settings:
    values = {k: v for k, v in vars(args).items() if k in WorkerSettings.model_fields or k in _TOP_LEVEL}
    return load_settings(args.config, flags_to_overrides(values, "worker", _TOP_LEVEL))


def engine_config(ws: WorkerSettings) -> Any:
    from worker.config import EngineConfig

    kwargs: dict[str, Any] = {k: getattr(ws, k) for k in _ENGINE_FIELDS if getattr(ws, k) is not None}
    if "attention" in kwargs:
        kwargs["attention_backend"] = kwargs.pop("attention")
    cfg = EngineConfig(dtype=ws.dtype, device=ws.device, enable_prefix_cache=ws.enable_prefix_cache,
                       quantization=ws.quantization, **kwargs)
    cfg.validate()
    return cfg


def run(args: argparse.Namespace) -> int:
    from config.logs import configure_logging

    settings = settings_from_args(args)
    configure_logging(settings.log_level, settings.log_format)
    from common.otel_setup import install_tracing

    install_tracing("switchyard-worker", settings.otel_endpoint)
    ws = settings.worker
    from worker.server.process.memory import bound_native_memory

    bound_native_memory()  # before torch runs its first matmul
    from worker.server.process.link_auth import InsecureBind, LinkAuth

    try:  # before the model loads: an open port without a cluster key is refused at once
        LinkAuth.check(settings.cluster_key(), ws.bind)
    except InsecureBind as exc:
        print(f"switchyard worker: {exc}", file=sys.stderr)
        return 2
    if ws.num_threads:
        import torch

        torch.set_num_threads(ws.num_threads)
    from worker.server.serve import ServerConfig, WorkerServer

    server_cfg = ServerConfig(bind=ws.bind, advertise=ws.advertise, worker_id=ws.worker_id,
                              redis_url=settings.redis_url, drain_timeout=ws.drain_timeout,
                              drain_handoff=ws.drain_handoff if ws.drain_handoff >= 0 else None,
                              gateway_timeout=ws.gateway_timeout, stats_interval=ws.stats_interval,
                              cluster_key=settings.cluster_key(), model_version=ws.model_version,
                              model_spec=ws.model, pool=ws.pool, role=ws.role,
                              disagg_stall_s=ws.disagg_stall_s, disagg_lease_s=ws.disagg_lease_s,
                              kv_events_endpoint=ws.kv_events_endpoint, kv_events_replay=ws.kv_events_replay,
                              kv_events_topic=ws.kv_events_topic, kv_events_plain=ws.kv_events_plain)
    try:
        engine = _build_engine(ws)
    except ValueError as exc:  # a vLLM-engine worker configured with what vLLM cannot do (VllmStartError)
        print(f"switchyard worker: {exc}", file=sys.stderr)
        return 2
    if ws.metrics_port:
        from worker.server.telemetry.worker_metrics import start_metrics_server

        start_metrics_server(ws.metrics_port, ws.metrics_host)
    # The ~300k objects of the loaded model and tokenizers live as long as the process: out of the collector's
    # sight, a full collection no longer walks them inside the loop (0.3 s each on the tiny model) and the
    # process exits in 0.5 s instead of 1.7.
    gc.freeze()
    return WorkerServer(engine, server_cfg).run()


def _build_engine(ws: WorkerSettings) -> Any:
    """Switchyard's engine on the loaded model, or (`--engine vllm`) vLLM's behind the same interface."""
    if ws.engine == "vllm":
        from worker.vllm_engine.launch import build_engine

        return build_engine(ws)
    from worker.engine.core import Engine
    from worker.model.loader import load_any

    loaded = load_any(ws.model, dtype=None if ws.dtype == "auto" else ws.dtype,
                      device=None if ws.device == "auto" else ws.device, quantization=ws.quantization)
    loaded.version = ws.model_version or ""  # the tier fingerprint names it (`LoadedModel.weights_id`)
    return Engine(loaded, engine_config(ws))
