"""Prometheus metrics of a worker process, served on its own port (`--metrics-port`).

Names are a contract with `docker/grafana-dashboard.json`; labels carry no tenant, key or prompt data
(the `fkey` label is a short prefix of the gateway's keyed fairness digest, for at most FAIR_LABELS keys).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from worker.engine.core import Engine, EngineStats, StepOutput
from worker.kvcache.tiers.tier_store import TierStats
from worker.server.telemetry import msp_metrics

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

PREFILL = Histogram("switchyard_worker_prefill_seconds", "First scheduled step to first token, per request",
                    buckets=LATENCY_BUCKETS)
QUEUE = Histogram("switchyard_worker_queue_seconds", "Admission to first scheduled step, per request",
                  buckets=LATENCY_BUCKETS)
STEP = Histogram("switchyard_worker_step_seconds", "Duration of one engine step", buckets=STEP_BUCKETS)
RUNNING = Gauge("switchyard_worker_running_requests", "Requests being decoded or prefilled")
WAITING = Gauge("switchyard_worker_waiting_requests", "Requests waiting to be scheduled")
KV_USED = Gauge("switchyard_worker_kv_pages_used", "KV cache pages in use")
KV_TOTAL = Gauge("switchyard_worker_kv_pages_total", "KV cache pages in the pool")
KV_CAPACITY = Gauge("switchyard_worker_kv_capacity_tokens",
                    "Tokens the KV cache pool holds (pages x page size)")
KV_DTYPE = Gauge("switchyard_worker_kv_dtype",
                 "1 for the dtype the KV pages are stored in (--kv-dtype resolved)", ["dtype"])
HIT_RATE = Gauge("switchyard_worker_prefix_hit_rate", "Share of prompt tokens served by the prefix cache")
BATCH = Gauge("switchyard_worker_batch_size", "Sequences sampled in the last engine step")
PREEMPTIONS = Counter("switchyard_worker_preemptions", "Sequences preempted for lack of KV pages")
PROMPT_TOKENS = Counter("switchyard_worker_prompt_tokens", "Prompt tokens admitted")
CACHED_TOKENS = Counter("switchyard_worker_cached_tokens", "Prompt tokens served by the prefix cache")
PREFILL_TOKENS = Counter("switchyard_worker_prefill_tokens_computed",
                         "Prompt tokens run through the model (prefill chunks; cache hits excluded)")
GENERATED_TOKENS = Counter("switchyard_worker_generated_tokens", "Tokens sampled")
SPEC_PROPOSED = Counter("switchyard_worker_spec_proposed_tokens", "N-gram draft tokens verified")
SPEC_ACCEPTED = Counter("switchyard_worker_spec_accepted_tokens", "Draft tokens the model agreed with")
SPEC_STEPS = Counter("switchyard_worker_spec_verify_steps", "Sequence-steps that verified drafts")
SPEC_RATE = Gauge("switchyard_worker_spec_acceptance_rate", "Accepted / proposed draft tokens since start")
SPEC_TPS = Gauge("switchyard_worker_spec_tokens_per_step",
                 "Tokens per verifying sequence per forward since start")
FAIR_SERVICE = Counter("switchyard_worker_fair_service_tokens",
                       "Fair-share service (w_p x computed prefill + w_d x decode tokens) per fairness key",
                       ["fkey"])
FAIR_QUEUE = Histogram("switchyard_worker_fair_queue_seconds",
                       "Admission to first scheduled step, per fairness key",
                       ["fkey"], buckets=LATENCY_BUCKETS)
FAIR_KEYS = Gauge("switchyard_worker_fair_keys", "Fairness keys the scheduler tracks")
TIER_HITS = Counter("switchyard_worker_kv_tier_hits", "KV pages restored from a tier below memory", ["tier"])
TIER_EVICTIONS = Counter("switchyard_worker_kv_tier_evictions", "KV pages a tier evicted", ["tier"])
TIER_BYTES = Gauge("switchyard_worker_kv_tier_bytes", "Bytes of KV pages a tier holds", ["tier"])
TIER_LOAD = Counter("switchyard_worker_kv_tier_load_seconds",
                    "Seconds spent restoring KV pages from the tiers")
TIER_RESTORED = Counter("switchyard_worker_kv_tier_restored_tokens",
                        "Prompt tokens restored from the KV tiers")
TIER_RESTORED_BYTES = Counter("switchyard_worker_kv_tier_restored_bytes",
                              "Bytes of KV pages restored from the tiers")
TIER_DISK_WRITES = Counter("switchyard_worker_kv_tier_disk_writes",
                           "KV page files the disk tier wrote or dropped "
                           "(outcome: written | dropped: queue or disk full)", ["outcome"])
TIER_DISK_CORRUPT = Counter("switchyard_worker_kv_tier_disk_corrupt",
                            "Disk tier files found corrupt (recomputed)")
TIER_SKIPPED = Counter("switchyard_worker_kv_tier_skipped_by_cost",
                       "Tier restores the cost model turned down")
TIER_DISK_FULL = Gauge("switchyard_worker_kv_tier_disk_full", "1 while the disk tier is full (writes stop)")
DISAGG_TRANSFERS = Counter("switchyard_worker_disagg_transfers",
                           "Disaggregated prefills this worker received pages "
                           "for, by how they ended (complete, fallback, cancelled)", ["outcome"])
DISAGG_FALLBACKS = Counter("switchyard_worker_disagg_fallbacks",
                           "Hinted requests prefilled here, by reason", ["reason"])
DISAGG_BYTES = Counter("switchyard_worker_disagg_received_bytes",
                       "KV page bytes received from prefill workers")
DISAGG_PUSHED = Counter("switchyard_worker_disagg_pushed_bytes", "KV page bytes pushed to decode workers")
DISAGG_SECONDS = Histogram("switchyard_worker_disagg_transfer_seconds",
                           "Hint to first token of a completed transfer", buckets=LATENCY_BUCKETS)
DISAGG_STRAY = Counter("switchyard_worker_disagg_stray_frames",
                       "Transfer frames with an unknown or ended id, dropped")
DISAGG_REASONS = ("short", "no_cache", "resumed", "invalid", "cached", "links", "decode_pages", "link",
                  "prefill_lost", "malformed", "stall", "incompatible", "refused", "draining", "bad_request",
                  "capacity", "ended", "error", "seqs")

FAIR_LABELS = 16  # distinct fkey label values per process; later keys share "other"
OTHER = "other"


class FairLabels:
    """Bounded label values for fairness keys: the first FAIR_LABELS
    keys get their hex prefix, then "other"."""

    def __init__(self, limit: int = FAIR_LABELS) -> None:
        self.limit = limit
        self._labels: dict[bytes, str] = {}

    def __call__(self, fkey: bytes) -> str:
        label = self._labels.get(fkey)
        if label is None:
            if len(self._labels) >= self.limit:
                return OTHER
            label = self._labels[fkey] = fkey[:4].hex() or OTHER
        return label


@dataclass(slots=True)
class _Pending:
    admitted_at: float
    prefill_at: float  # 0.0 until the first scheduled step
    label: str  # fkey label


class WorkerMetrics:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.block_size = engine.config.block_size
        self._pending: dict[str, _Pending] = {}  # requests without a first token yet
        self._unscheduled = 0  # entries of _pending whose prefill has not started
        self._prompt = self._cached = self._generated = self._preempted = self._prefilled = 0
        self._spec = [0, 0, 0]  # proposed, accepted, verify steps already counted
        self.fair_labels = FairLabels()
        KV_DTYPE.labels(engine.kv_dtype).set(1)
        msp_metrics.describe_cache(self.block_size, engine.stats().kv_total_tokens)
        self._fair_seen: dict[str, float] = {}  # per label: service total already counted
        self._tier_seen: dict[str, int] = {}  # KV tier counters already counted
        self._tier_load = 0.0

    def admitted(self, rid: str, fkey: bytes = b"") -> None:
        self._pending[rid] = _Pending(time.monotonic(), 0.0, self.fair_labels(fkey))
        self._unscheduled += 1

    def timing(self, rid: str, started: float) -> tuple[float, float] | None:
        """(admitted, prefill started) of a request without a first output yet, in time.monotonic(); a request
        not seen scheduled before the step that began at `started` started its prefill then. None: unknown."""
        p = self._pending.get(rid)
        return None if p is None else (p.admitted_at, p.prefill_at or started)

    def stepped(self, outputs: Sequence[StepOutput], started: float) -> None:
        """After an engine step that began at `started` (time.monotonic())."""
        ended = time.monotonic()
        STEP.observe(ended - started)
        sampled = 0
        pending = self._pending
        for out in outputs:
            if out.finish_reason != "abort":
                sampled += 1
            if pending and out.rid in pending and (out.new_tokens or out.finish_reason is not None):
                self._first_token(out, started, ended)
        BATCH.set(sampled)
        if self._unscheduled:
            self._mark_scheduled(started)

    def _first_token(self, out: StepOutput, started: float, ended: float) -> None:
        p = self._pending.pop(out.rid)
        prefill_at = p.prefill_at
        if prefill_at == 0.0:
            self._unscheduled -= 1
            prefill_at = started
        if out.finish_reason == "abort":
            return
        queued = max(0.0, prefill_at - p.admitted_at)
        QUEUE.observe(queued)
        FAIR_QUEUE.labels(p.label).observe(queued)
        PREFILL.observe(ended - prefill_at)

    def _mark_scheduled(self, started: float) -> None:
        # Only while some request has not been scheduled yet: O(waiting), not per token.
        if self.engine.scheduler is None:
            return  # an engine without Switchyard's scheduler (vLLM's): queue time ends at the first token
        waiting = {seq.rid for seq in self.engine.scheduler.waiting}
        for rid, p in self._pending.items():
            if p.prefill_at == 0.0 and rid not in waiting:
                p.prefill_at = started
                self._unscheduled -= 1

    def _forget_gone(self) -> None:
        """Drop requests that left the engine without an output we saw (rare: never per step)."""
        for rid in [r for r in self._pending if not self.engine.is_running(r)]:
            if self._pending.pop(rid).prefill_at == 0.0:
                self._unscheduled -= 1

    def refresh(self) -> None:
        """Copy engine stats into gauges; counters advance by the growth of the engine's totals."""
        s = self.engine.stats()
        bs = self.block_size
        if len(self._pending) > s.num_waiting + s.num_running:
            self._forget_gone()
        RUNNING.set(s.num_running)
        if s.num_running == 0:
            BATCH.set(0)  # idle: no batch (the last step's size would linger otherwise)
        WAITING.set(s.num_waiting)
        KV_TOTAL.set(s.kv_total_tokens // bs)
        KV_CAPACITY.set(s.kv_total_tokens)
        KV_USED.set((s.kv_total_tokens - s.kv_free_tokens) // bs)
        HIT_RATE.set(s.prefix_hit_rate)
        msp_metrics.refresh(s)  # the Kubernetes routers' names (Gateway API Inference Extension)
        self._prompt = _advance(PROMPT_TOKENS, self._prompt, s.prompt_tokens)
        self._cached = _advance(CACHED_TOKENS, self._cached, s.cached_tokens)
        self._prefilled = _advance(PREFILL_TOKENS, self._prefilled, s.prefill_tokens_computed)
        self._generated = _advance(GENERATED_TOKENS, self._generated, s.generated_tokens)
        self._preempted = _advance(PREEMPTIONS, self._preempted, s.preemptions)
        self._refresh_spec(s)
        self._refresh_fair()
        if s.tiers is not None:
            self._refresh_tiers(s.tiers)

    def _refresh_tiers(self, t: TierStats) -> None:
        seen = self._tier_seen
        for name, counter, total in (("ram_hits", TIER_HITS.labels("ram"), t.ram_hits),
                                     ("disk_hits", TIER_HITS.labels("disk"), t.disk_hits),
                                     ("ram_ev", TIER_EVICTIONS.labels("ram"), t.ram_evictions),
                                     ("disk_ev", TIER_EVICTIONS.labels("disk"), t.disk_evictions),
                                     ("restored", TIER_RESTORED, t.restored_tokens),
                                     ("restored_b", TIER_RESTORED_BYTES, t.restored_bytes),
                                     ("written", TIER_DISK_WRITES.labels("written"), t.disk_writes),
                                     ("dropped", TIER_DISK_WRITES.labels("dropped"), t.disk_dropped),
                                     ("corrupt", TIER_DISK_CORRUPT, t.disk_corrupt),
                                     ("skipped", TIER_SKIPPED, t.skipped_by_cost)):
            seen[name] = _advance(counter, seen.get(name, 0), total)
        TIER_LOAD.inc(max(0.0, t.load_seconds - self._tier_load))
        self._tier_load = max(self._tier_load, t.load_seconds)
        TIER_BYTES.labels("ram").set(t.ram_bytes)
        TIER_BYTES.labels("disk").set(t.disk_bytes)
        TIER_DISK_FULL.set(int(t.disk_full))

    def _refresh_spec(self, s: EngineStats) -> None:
        seen = self._spec
        seen[0] = _advance(SPEC_PROPOSED, seen[0], s.spec_proposed_tokens)
        seen[1] = _advance(SPEC_ACCEPTED, seen[1], s.spec_accepted_tokens)
        seen[2] = _advance(SPEC_STEPS, seen[2], s.spec_verify_steps)
        SPEC_RATE.set(s.spec_acceptance_rate)
        SPEC_TPS.set(s.spec_tokens_per_step)

    def _refresh_fair(self) -> None:
        """Per label, advance the service counter by the growth of its keys' total (forgotten keys: no
        advance)."""
        if self.engine.scheduler is None:
            return
        fair = self.engine.scheduler.fair
        FAIR_KEYS.set(len(fair))
        totals: dict[str, float] = {}
        for key, service in fair.services():
            label = self.fair_labels(key)
            totals[label] = totals.get(label, 0.0) + service
        seen = self._fair_seen
        for label, total in totals.items():
            grown = total - seen.get(label, 0.0)
            if grown > 0:
                FAIR_SERVICE.labels(label).inc(grown)
            seen[label] = total


def _advance(counter: Counter, seen: int, total: int) -> int:
    if total > seen:
        counter.inc(total - seen)
    return max(seen, total)


def start_metrics_server(port: int, host: str = "0.0.0.0") -> None:
    """Serve /metrics of this process on `host:port` from a daemon thread (port 0: disabled)."""
    if port:
        start_http_server(port, addr=host)
