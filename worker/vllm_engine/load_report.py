"""A vLLM engine's load as Switchyard's `EngineStats`: KV use and cache hits from vLLM's own metrics, beside
the step costs the adapter measures around its steps."""

from __future__ import annotations

import time
from typing import Any

from worker.engine.records.outputs import EngineStats, StepCosts

METRICS_TTL_S = 0.25  # vLLM's metric snapshot walks its registry: at most this often


class EngineCounters:
    """vLLM's gauges and counters (`LLMEngine.get_metrics`), read at most every METRICS_TTL_S."""

    def __init__(self, llm: Any, block_size: int, num_blocks: int) -> None:
        self._llm = llm
        self.kv_total_tokens = block_size * num_blocks
        self._values: dict[str, float] = {}
        self._read_at = 0.0

    def _read(self) -> dict[str, float]:
        now = time.monotonic()
        if now - self._read_at >= METRICS_TTL_S:
            self._read_at = now
            values: dict[str, float] = {}
            for metric in self._llm.get_metrics():
                value = getattr(metric, "value", None)
                # vLLM's own series carry its `engine` label (the worker's model-server gauges share names)
                if isinstance(value, int | float) and "engine" in getattr(metric, "labels", {}):
                    values[metric.name] = values.get(metric.name, 0.0) + float(value)
            self._values = values
        return self._values

    def stats(self, *, num_waiting: int, num_running: int, costs: StepCosts, steps: int,
              backlog: int) -> EngineStats:
        v = self._read()
        used = min(1.0, max(0.0, v.get("vllm:kv_cache_usage_perc", 0.0)))
        queries, hits = v.get("vllm:prefix_cache_queries", 0.0), v.get("vllm:prefix_cache_hits", 0.0)
        prompt = int(v.get("vllm:prompt_tokens", 0.0))
        return EngineStats(
            num_waiting=num_waiting, num_running=num_running,
            kv_free_tokens=int(self.kv_total_tokens * (1.0 - used)), kv_total_tokens=self.kv_total_tokens,
            prefix_hit_rate=hits / queries if queries else 0.0,
            preemptions=int(v.get("vllm:num_preemptions", 0.0)), prompt_tokens=prompt,
            prefill_tokens_computed=max(0, prompt - int(hits)),
            generated_tokens=int(v.get("vllm:generation_tokens", 0.0)), steps=steps,
            cached_tokens=int(hits), attention_backend="vllm", prefill_tps=costs.prefill_tps,
            step_s=costs.step_s, prefill_backlog=backlog)

