"""The model-server-protocol metrics (Gateway API Inference Extension) follow the engine: queued and running
requests, KV-cache use as a 0-1 fraction, the cache config, in the
Prometheus text the endpoint picker reads."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from worker.config import EngineConfig
from worker.engine.core import Engine
from worker.kvcache.tensors import bytes_per_token
from worker.model.tiny_model import load_tiny_model
from worker.protocol import SamplingParams
from worker.server.telemetry.worker_metrics import WorkerMetrics

EPP_DEFAULTS = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


@pytest.fixture(scope="module")
def engine() -> Engine:
    torch.set_num_threads(1)
    tiny = load_tiny_model(dtype="float32", device="cpu")
    per_page = bytes_per_token(tiny.config, tiny.dtype) * 16
    return Engine(tiny, EngineConfig(kv_cache_bytes=64 * per_page, max_num_seqs=2, enable_prefix_cache=False,
                                     prefill_step_tokens=0))  # both slots filled in one step


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_protocol_metrics_follow_the_engine(engine: Engine) -> None:
    metrics = WorkerMetrics(engine)
    metrics.refresh()
    assert [sample(n) for n in EPP_DEFAULTS] == [0, 0, 0]
    assert sample("vllm:cache_config_info", block_size="16", num_gpu_blocks="64") == 1
    for i in range(5):  # two run (max_num_seqs), three wait
        engine.add_request(f"r{i}", list(range(10 + i, 10 + i + 40)),
                           SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    metrics.refresh()
    s = engine.stats()
    assert (s.num_running, s.num_waiting) == (2, 3)
    assert sample("vllm:num_requests_running") == 2 and sample("vllm:num_requests_waiting") == 3
    used = sample("vllm:kv_cache_usage_perc")
    assert used == pytest.approx(1 - s.kv_free_tokens / s.kv_total_tokens) and 0 < used <= 1
    assert sample("vllm:gpu_cache_usage_perc") == used  # the pre-v1.0 endpoint picker's name
    for i in range(5):
        engine.abort(f"r{i}")
    while engine.has_work():
        engine.step()
    metrics.refresh()
    assert [sample(n) for n in EPP_DEFAULTS] == [0, 0, 0]


def test_the_exposition_names_the_endpoint_pickers_defaults_as_gauges() -> None:
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(REGISTRY).decode())}
    for name in (*EPP_DEFAULTS, "vllm:cache_config_info"):
        assert families[name].type == "gauge", name
