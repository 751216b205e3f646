"""What the engine hands out: one request's output of a step (`StepOutput`), the engine's counters
(`EngineStats`) and its measured step costs (`StepCosts`).
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.engine.records.sequence import ScheduledBatch
from worker.kvcache.tiers.tier_store import TierStats
from worker.protocol import RequestError


@dataclass(slots=True)
class StepOutput:
    rid: str
    new_tokens: list[int]  # a stop token that ends the request is not included
    finish_reason: str | None  # None while running; "stop" | "length" | "abort"
    cached_tokens: int
    logprobs: list[float] | None
    top_ids: list[list[int]] | None = None  # with `top_logprobs`: per new token, the k most likely ids
    top_logprobs: list[list[float]] | None = None
    error: RequestError | None = None  # the request ended with this error (finish_reason "error")


@dataclass(slots=True)
class EngineStats:
    num_waiting: int
    num_running: int
    kv_free_tokens: int  # free + evictable cached pages, in tokens: what a new request can get
    kv_total_tokens: int
    prefix_hit_rate: float  # prompt tokens served by the cache / prompt tokens of admitted requests
    preemptions: int
    prompt_tokens: int
    prefill_tokens_computed: int  # tokens run through the model in prefill chunks (cache hits excluded)
    generated_tokens: int = 0
    steps: int = 0
    cached_tokens: int = 0  # prompt tokens served by the prefix cache (first admissions)
    free_pages: int = 0
    cached_pages: int = 0
    evictable_pages: int = 0
    locked_pages: int = 0
    evicted_pages: int = 0
    quantization: str = "none"  # weight mode actually in use (worker.quant.weights)
    attention_backend: str = "torch"  # the backend chosen (worker.model.backends.choose_backend)
    cuda_graphs: bool = False  # decode steps replay CUDA graphs (worker.model.cuda_graphs)
    prefill_attention: str = ""  # torch backend: "kernel" (C++) or "sdpa" (worker.model.prefill_choice)
    spec_proposed_tokens: int = 0  # n-gram drafts verified
    spec_accepted_tokens: int = 0  # drafts the target agreed with
    spec_verify_steps: int = 0  # sequence-steps that verified drafts
    tiers: TierStats | None = None  # KV tiers below the radix cache (None: off)
    prefill_tps: float = 0.0  # measured prompt tokens a second in steps that prefill (0.0: none measured)
    step_s: float = 0.0  # measured seconds of one engine step (0.0: none measured)
    prefill_backlog: int = 0  # prompt tokens of waiting and prefilling requests not yet computed

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_proposed_tokens if self.spec_proposed_tokens else 0.0

    @property
    def spec_tokens_per_step(self) -> float:
        """Tokens a verifying sequence got per forward (1.0 = no gain); 0.0 before any verification."""
        n = self.spec_verify_steps
        return (n + self.spec_accepted_tokens) / n if n else 0.0


COST_SMOOTHING = 0.2  # weight of the newest step in the moving averages


@dataclass(slots=True)
class StepCosts:
    """Exponential moving averages of what steps cost: seconds per step, prompt tokens per second of steps
    that prefill (what admission predicts a request's time to first token from)."""

    step_s: float = 0.0
    prefill_tps: float = 0.0

    def stepped(self, batch: ScheduledBatch, seconds: float) -> None:
        self.record(seconds, sum(n for _, n in batch.prefills))

    def record(self, seconds: float, prefilled: int) -> None:
        """A step of `seconds` that computed `prefilled` prompt tokens (0: decodes only)."""
        if seconds <= 0:
            return
        self.step_s = _mix(self.step_s, seconds)
        if prefilled:
            self.prefill_tps = _mix(self.prefill_tps, prefilled / seconds)


def _mix(old: float, new: float) -> float:
    """The moving average's next value (its first sample is taken as is)."""
    return new if old <= 0 else old + COST_SMOOTHING * (new - old)
