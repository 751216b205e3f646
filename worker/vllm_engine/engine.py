"""`VllmEngine`: the engine surface `WorkerServer` drives (add, step, abort, stats), over vLLM's `LLMEngine`.

It streams each request's new tokens per step (vLLM's DELTA outputs), keeps tenants' caches apart with vLLM's
`cache_salt`, and reports load from the engine's own counters. What it has not (Switchyard's radix cache, KV
tiers, page exports, fair scheduler) is None, so the server's features built on them stay off.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, NoReturn

from worker.engine.records.outputs import EngineStats, StepCosts, StepOutput
from worker.engine.records.request_errors import check_context, check_prompt
from worker.protocol import RequestError, SamplingParams, bad_request
from worker.text.tokenizer import Tokenizer
from worker.vllm_engine.load_report import EngineCounters
from worker.vllm_engine.sampling import vllm_sampling_kwargs

log = logging.getLogger(__name__)

PRIORITY_POLICY = "priority"
ENGINE_DEAD_EXIT = 3  # the worker's exit code when vLLM's engine process died
CORE_WATCH_S = 0.5  # how often the watcher looks at vLLM's engine-dead flag


@dataclass(slots=True)
class EngineView:
    """The engine setting the server and its metrics read (Switchyard's `EngineConfig` has it too)."""

    block_size: int


@dataclass(slots=True)
class _Live:
    prompt_len: int  # tokens vLLM prefills (the resumed tokens included)
    logprobs: bool
    top_k: int
    started: bool = False  # some output came back: it left the waiting queue


class VllmEngine:
    """Switchyard's engine interface over an in-process vLLM `LLMEngine` (v1)."""

    kind = "vllm"  # registered, so operators and gateways can tell the engines apart
    cache = None  # no Switchyard radix cache: no block reports in stats, no disaggregation, no KV promises
    pool = None
    exports = None
    scheduler = None

    def __init__(self, llm: Any, tokenizer: Tokenizer) -> None:
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
        from vllm.sampling_params import SamplingParams as VllmSampling

        self.llm = llm
        self._vllm_sampling, self._structured = VllmSampling, StructuredOutputsParams
        self._delta = RequestOutputKind.DELTA
        vcfg = llm.vllm_config
        self.model_id = tokenizer.model_id
        self.tokenizer_version = tokenizer.version
        self.vocab_size = int(vcfg.model_config.get_vocab_size())
        self.max_context = int(vcfg.model_config.max_model_len)
        self.config = EngineView(int(vcfg.cache_config.block_size))
        self.kv_dtype = str(vcfg.cache_config.cache_dtype)
        self.kv_fingerprint = b""  # no page transfers: a prefill peer never matches
        self._priorities = vcfg.scheduler_config.policy == PRIORITY_POLICY
        self._live: dict[str, _Live] = {}
        self._aborted: list[str] = []
        self._counters = EngineCounters(llm, self.config.block_size,
                                        int(vcfg.cache_config.num_gpu_blocks or 0))
        self._costs = StepCosts()
        self._steps = 0
        self._closed = False
        threading.Thread(target=self._watch_core, name="vllm-core-watch", daemon=True).start()
        par = vcfg.parallel_config
        log.info("vLLM engine: tensor_parallel_size=%d pipeline_parallel_size=%d dtype=%s kv_cache_dtype=%s "
                 "%d KV blocks of %d tokens, max_model_len=%d", par.tensor_parallel_size,
                 par.pipeline_parallel_size, vcfg.model_config.dtype, self.kv_dtype,
                 self._counters.kv_total_tokens // self.config.block_size, self.config.block_size,
                 self.max_context)

    # ---- requests ----

    def add_request(self, rid: str, token_ids: list[int], sampling: SamplingParams, priority: int = 0,
                    namespace: bytes | str = b"", fkey: bytes = b"", weight: float = 1.0, resumed: int = 0,
                    ttft: float = 0.0) -> None:
        """Queue a request in vLLM; RequestError (400 with `param`) for what it cannot run as asked.
        `fkey`, `weight` and `ttft` are accepted and unused: vLLM schedules by priority, then arrival."""
        if rid in self._live:
            raise bad_request("duplicate request id", "rid")
        check_prompt(token_ids, priority, resumed, sampling.max_tokens, self.vocab_size)
        check_context(token_ids, resumed, sampling.max_tokens, self.max_context)
        kw = vllm_sampling_kwargs(sampling, self.vocab_size, resumed)
        grammar = kw.pop("grammar", None)
        if grammar is not None:
            kw["structured_outputs"] = self._structured(grammar=grammar)
        try:
            params = self._vllm_sampling(output_kind=self._delta, **kw)
        except ValueError as exc:  # what vLLM's own checks refuse
            raise bad_request(f"vLLM refused the sampling parameters: {exc}", "sampling") from None
        prompt: dict[str, Any] = {"prompt_token_ids": list(token_ids)}
        if namespace:  # tenants never share cached blocks (vLLM's salt is text: the namespace's hex)
            prompt["cache_salt"] = namespace.hex() if isinstance(namespace, bytes) else str(namespace)
        if self._core_dead():
            self._exit_dead()
        self.llm.add_request(rid, prompt, params, priority=int(priority) if self._priorities else 0)
        self._live[rid] = _Live(len(token_ids), sampling.logprobs, sampling.top_logprobs)

    def abort(self, rid: str) -> bool:
        """Stop a request; its `abort` output comes with the next step. False: not running here."""
        if self._live.pop(rid, None) is None:
            return False
        self.llm.abort_request([rid])
        self._aborted.append(rid)
        return True

    def is_running(self, rid: str) -> bool:
        return rid in self._live

    def ready(self) -> bool:
        return bool(self._aborted) or bool(self._live) or self._core_dead()

    def _core_dead(self) -> bool:
        """vLLM's engine process died (its client's monitor says so): unrecoverable."""
        resources = getattr(getattr(self.llm, "engine_core", None), "resources", None)
        return bool(getattr(resources, "engine_dead", False))

    def _watch_core(self) -> None:
        """Wake a step blocked on vLLM's outputs when its engine process dies: vLLM's sync client waits on its
        output queue without a deadline, and its monitor marks the engine dead without waking it."""
        while not self._closed:
            if self._core_dead():
                outputs = getattr(self.llm.engine_core, "outputs_queue", None)
                if outputs is not None:
                    outputs.put_nowait(RuntimeError("the vLLM engine process died"))
                return
            time.sleep(CORE_WATCH_S)

    def _exit_dead(self) -> NoReturn:
        """Stop the worker process: its gateways see the link drop and resume its streams on other workers at
        once, and it leaves the registry (a worker that answers every request with an error is worse)."""
        log.critical("the vLLM engine process died: the worker exits (exit code %d)", ENGINE_DEAD_EXIT)
        raise SystemExit(ENGINE_DEAD_EXIT)

    def has_work(self) -> bool:
        return self.ready()

    def prepare_grammars(self) -> None:
        """Nothing to warm: vLLM compiles grammars in its own engine process."""

    # ---- stepping ----

    def step(self) -> list[StepOutput]:
        """One vLLM step's outputs as Switchyard's (aborts since the last step first)."""
        outputs = [StepOutput(rid, [], "abort", 0, None) for rid in self._aborted]
        self._aborted.clear()
        if self._core_dead():
            self._exit_dead()
        if not self._live:
            return outputs
        if not self.llm.has_unfinished_requests():  # its step would wait for outputs that never come
            return outputs + self._lost()
        started = time.perf_counter()
        try:
            results = self.llm.step()
        except Exception:
            if self._core_dead():
                self._exit_dead()
            raise
        prefilled = 0
        for res in results:
            live = self._live.get(res.request_id)
            if live is None:
                continue  # aborted here while vLLM was computing it
            if not live.started:
                live.started = True
                prefilled += live.prompt_len - int(res.num_cached_tokens or 0)
            out = self._output(res, live)
            if out.finish_reason is not None:
                del self._live[res.request_id]
            outputs.append(out)
        self._steps += 1
        self._costs.record(time.perf_counter() - started, prefilled)
        return outputs

    def _lost(self) -> list[StepOutput]:
        """End the requests vLLM no longer holds (not expected: each ends with an output) with a retryable
        error, so that their gateways resume them rather than wait."""
        error = RequestError("internal", "the vLLM engine dropped the request", retryable=True)
        lost = [StepOutput(rid, [], "error", 0, None, error=error) for rid in self._live]
        self._live.clear()
        return lost

    def _output(self, res: Any, live: _Live) -> StepOutput:
        comp = res.outputs[0]
        tokens = list(comp.token_ids)
        reason = comp.finish_reason
        entries = list(comp.logprobs or ()) if (live.logprobs or live.top_k) else []
        if reason == "stop" and tokens and not isinstance(comp.stop_reason, str):
            # a stop token (stop_reason: its id) or an EOS (None) ended it: vLLM's output holds it,
            # Switchyard's never does (no stop strings are sent: the gateway matches those)
            tokens.pop()
            entries = entries[:len(tokens)]
        if reason not in (None, "stop", "length", "abort"):
            error = RequestError("internal", f"vLLM ended the request: {reason}", retryable=True)
            return StepOutput(res.request_id, [], "error", 0, None, error=error)
        out = StepOutput(res.request_id, tokens, reason, int(res.num_cached_tokens or 0), None)
        if live.logprobs:
            out.logprobs = [float(e[t].logprob) for e, t in zip(entries, tokens, strict=True)]
        if live.top_k:
            tops = [sorted((v.rank, tid, v.logprob) for tid, v in e.items() if v.rank <= live.top_k)
                    for e in entries]
            out.top_ids = [[tid for _, tid, _ in top] for top in tops]
            out.top_logprobs = [[float(lp) for _, _, lp in top] for top in tops]
        return out

    # ---- load ----

    def stats(self) -> EngineStats:
        waiting = [live for live in self._live.values() if not live.started]
        return self._counters.stats(num_waiting=len(waiting), num_running=len(self._live) - len(waiting),
                                    costs=self._costs, steps=self._steps,
                                    backlog=sum(live.prompt_len for live in waiting))

    def close(self) -> None:
        """Stop vLLM's engine process (and its workers)."""
        self._closed = True
        core = getattr(self.llm, "engine_core", None)
        if core is not None:
            core.shutdown()
