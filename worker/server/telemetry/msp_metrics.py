"""The metrics Kubernetes inference routers scrape: the Gateway API Inference Extension's model-server
protocol (queued and running requests, KV-cache utilization, cache config), under vLLM's names, which are
its endpoint picker's defaults. docs/deployment.md has the InferencePool that points at them.
"""

from __future__ import annotations

from prometheus_client import Gauge

from worker.engine.core import EngineStats

QUEUED = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled (model-server protocol)")
RUNNING = Gauge("vllm:num_requests_running", "Requests being prefilled or decoded (model-server protocol)")
KV_USAGE = Gauge("vllm:kv_cache_usage_perc",
                 "KV cache pages in use, 0 to 1 (cached but unreferenced pages free)")
KV_USAGE_OLD = Gauge("vllm:gpu_cache_usage_perc",
                     "Same as vllm:kv_cache_usage_perc (the name of EPPs before v1.0)")
CACHE_INFO = Gauge("vllm:cache_config_info", "1, labelled with the KV page size and the pages in the pool",
                   ["block_size", "num_gpu_blocks"])


def describe_cache(block_size: int, total_tokens: int) -> None:
    """Set the cache-config info once the pool is sized (labels: page size in tokens, pages)."""
    CACHE_INFO.clear()
    CACHE_INFO.labels(str(block_size), str(total_tokens // max(1, block_size))).set(1)


def refresh(s: EngineStats) -> None:
    QUEUED.set(s.num_waiting)
    RUNNING.set(s.num_running)
    usage = (s.kv_total_tokens - s.kv_free_tokens) / s.kv_total_tokens if s.kv_total_tokens else 0.0
    KV_USAGE.set(usage)
    KV_USAGE_OLD.set(usage)
