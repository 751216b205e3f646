"""The engine API (add requests, step, abort, stats): everything above the worker uses only this.

Requests are validated before any state changes; stop rules and page release happen here.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time

import torch

from worker.config import CPU_PREFILL_STEP_TOKENS, EngineConfig
from worker.engine.export import PageExport
from worker.engine.prefix_pins import PrefixPins
from worker.engine.records.outputs import EngineStats, StepCosts, StepOutput
from worker.engine.records.request_errors import RequestError, bad_request, check_context, check_prompt
from worker.engine.records.sequence import NgramIndex, Priority, ScheduledBatch, SeqStatus, Sequence
from worker.engine.runner import ModelRunner, StepResult
from worker.engine.scheduling.fairness import check_fair_params
from worker.engine.scheduling.grammar_wait import CompileWait, ready_state, replay_output
from worker.engine.scheduling.restore import make_restorer
from worker.engine.scheduling.scheduler import Scheduler
from worker.engine.scheduling.speculative import speculation_allowed
from worker.kvcache.page_pool import PagePool, pages_for
from worker.kvcache.radix_cache import RadixCache
from worker.kvcache.tensors import num_pages_for
from worker.kvcache.tiers.pages import PageCodec, fingerprint
from worker.model.kv_dtype import resolve_kv_dtype
from worker.model.loader import LoadedModel
from worker.protocol import SamplingParams
from worker.sample.grammar import BatchMasker, GrammarCache, grammar_tokenizer

__all__ = ["DEFAULT_NAMESPACE", "Engine", "EngineStats", "Priority", "StepOutput"]

DEFAULT_NAMESPACE = b"default"  # cache namespace of requests that name none (in-process callers)
log = logging.getLogger(__name__)


class Engine:
    runner_class: type[ModelRunner] = ModelRunner
    kind = "switchyard"  # the registry's `engine` (worker.vllm_engine's is "vllm")

    def __init__(self, model: LoadedModel, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        config.validate()
        if config.prefill_step_tokens is None:
            auto = CPU_PREFILL_STEP_TOKENS if model.device.type == "cpu" else 0
            config = dataclasses.replace(config, prefill_step_tokens=auto)
        if config.num_threads is not None and model.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.loaded = model
        self.model_id = model.model_id
        self.tokenizer = model.tokenizer
        self.tokenizer_version = model.tokenizer_version
        self.vocab_size = model.config.vocab_size
        self.max_context = model.max_context
        self.kv_dtype, why = resolve_kv_dtype(config, model.device)
        num_pages = num_pages_for(model.config, config, model.dtype, model.device, self.kv_dtype)
        log.info("KV cache: %s pages (asked %s: %s), %d pages of %d tokens", self.kv_dtype, config.kv_dtype,
                 why, num_pages, config.block_size)
        self.pool = PagePool(num_pages)
        self.cache = RadixCache(self.pool, config.block_size) if config.enable_prefix_cache else None
        self.scheduler = Scheduler(config, self.pool, self.cache)
        self.pins = PrefixPins(self.cache)  # transferred prefixes held for their waiting requests
        self.runner = self.runner_class(model, config, num_pages)
        codec = PageCodec(self.runner.kv)  # pages to and from host rows: the KV tiers' and disaggregation's
        self.kv_fingerprint = fingerprint(model.model_id, model.weights_id, model.tokenizer_version,
                                          self.runner.kv)
        self.restorer = make_restorer(config, self.cache, self.pool, codec, self.kv_fingerprint)
        self.scheduler.restorer = self.restorer
        self.exports = PageExport(codec, config.block_size)  # disaggregated prefill's pages
        self._seqs: dict[str, Sequence] = {}
        self._aborted: list[str] = []
        self._arrivals = 0
        self._rng = random.Random()
        self._prompt_tokens = 0
        self._prefill_computed = 0
        self._generated = 0
        self._steps = 0
        self._spec = [0, 0, 0]  # proposed, accepted, verify steps
        self.costs = StepCosts()
        self._grammars: CompileWait | None = None  # built with the first grammar request
    # ---- requests ----

    def add_request(self, rid: str, token_ids: list[int], sampling: SamplingParams,
                    priority: Priority = Priority.INTERACTIVE, namespace: bytes = b"", fkey: bytes = b"",
                    weight: float = 1.0, resumed: int = 0, ttft: float = 0.0) -> None:
        """`fkey`/`weight`: fairness key and share (worker.engine.scheduling.fairness); no key => the cache
        namespace's. `ttft`: unix seconds its first token is due by (0.0: none; the waiting order's).

        `resumed`: the last this many of `token_ids` were streamed already (by a worker that was lost): they
        are output, so sampling positions, penalties, `max_tokens` and the grammar carry on after them."""
        self.check_request(rid, token_ids, sampling, priority, namespace, fkey, weight, resumed)
        prompt_len = len(token_ids) - resumed
        namespace = namespace or DEFAULT_NAMESPACE
        key, compiling = (None, None) if sampling.grammar is None else \
            self._compile_wait().submit(sampling.grammar, namespace)
        if compiling is not None and self.runner.masker is None:
            self.runner.masker = BatchMasker(self.vocab_size)  # steps without grammar rows never build masks
        grammar = ready_state(compiling)
        stops = set(sampling.stop_token_ids)
        # a grammar ends with EOS whatever ignore_eos says
        if not sampling.ignore_eos or compiling is not None:
            stops.add(self.tokenizer.eos_token_id)
        seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(32)
        seq = Sequence(rid, list(token_ids), prompt_len, sampling, Priority(priority), self._arrivals,
                       namespace, seed & 0xFFFFFFFFFFFFFFFF, frozenset(stops),
                       fkey=fkey or namespace, weight=float(weight), grammar=grammar, ttft_deadline=ttft)
        cfg = self.config
        if cfg.spec_tokens and cfg.spec_max_batch and compiling is None and speculation_allowed(sampling):
            seq.ngram = NgramIndex(cfg.spec_ngram_min, cfg.spec_ngram_max)
        if grammar is not None and not replay_output(seq):
            raise bad_request("the resumed tokens do not fit the request's grammar", "resumed")
        self._arrivals += 1
        self._prompt_tokens += len(token_ids)
        self._seqs[rid] = seq
        if compiling is not None and grammar is None:
            self._grammars.hold(seq, key, compiling)  # type: ignore[union-attr]  # scheduled once compiled
        else:
            self.scheduler.add(seq)
        if self.restorer is not None:
            self.restorer.arrived(seq)

    def check_request(self, rid: str, token_ids: list[int], sampling: SamplingParams,
                      priority: Priority = Priority.INTERACTIVE, namespace: bytes = b"", fkey: bytes = b"",
                      weight: float = 1.0, resumed: int = 0) -> None:
        """Every check `add_request` makes before changing any state: RequestError names the first failing."""
        self._validate(rid, sampling)
        check_prompt(token_ids, priority, resumed, sampling.max_tokens, self.vocab_size)
        if not isinstance(namespace, bytes):
            raise bad_request("cache namespace must be bytes", "ns")
        check_fair_params(fkey, weight)
        total = check_context(token_ids, resumed, sampling.max_tokens, self.max_context)
        if pages_for(total, self.config.block_size) > self.pool.num_pages:
            raise RequestError("capacity", f"prompt + max_tokens = {total} tokens can never fit the KV cache "
                               f"({self.pool.num_pages * self.config.block_size} tokens)", param="max_tokens")

    def _compile_wait(self) -> CompileWait:
        """The grammar cache and its waiting room, made with the first grammar request (its first compile job
        builds llguidance's tokenizer)."""
        if self._grammars is None:
            cfg = self.config
            cache = GrammarCache(lambda: grammar_tokenizer(self.tokenizer, vocab_size=self.vocab_size),
                                 max_pending=cfg.grammar_max_pending,
                                 max_pending_per_ns=cfg.grammar_max_pending_per_ns)
            self._grammars = CompileWait(cache, cfg.grammar_compile_timeout_s)
        return self._grammars

    def prepare_grammars(self) -> None:
        """Start building the grammar tokenizer in the background (servers call this at start)."""
        self._compile_wait().cache.warm()

    def _settle_grammars(self) -> list[StepOutput]:
        """Schedule the requests whose grammar compiled; end those whose compile failed or timed out."""
        ready, failed = self._grammars.settle()  # type: ignore[union-attr]
        for seq in ready:
            if replay_output(seq):
                self.scheduler.add(seq)
            else:
                failed.append((seq.rid, bad_request("the resumed tokens do not fit the request's grammar",
                                                    "resumed")))
        outputs = []
        for rid, error in failed:
            seq = self._seqs.pop(rid)
            self.pins.release(rid)
            seq.status, seq.finish_reason = SeqStatus.FINISHED, "error"
            outputs.append(StepOutput(rid, [], "error", 0, None, error=error))
        return outputs

    def close(self) -> None:
        """Stop the grammar compile threads (if any were started)."""
        if self._grammars is not None:
            self._grammars.cache.close()
        if self.restorer is not None:
            self.restorer.tiers.close()

    def _validate(self, rid: str, sampling: SamplingParams) -> None:
        if not isinstance(rid, str) or not rid:
            raise bad_request("rid must be a non-empty string", "rid")
        if rid in self._seqs:
            raise bad_request(f"duplicate request id {rid!r}", "rid")
        if not isinstance(sampling, SamplingParams):
            raise bad_request("sampling must be SamplingParams", "sampling")
        sampling.validate(self.vocab_size)

    def abort(self, rid: str) -> bool:
        self.exports.forget(rid)
        seq = self._seqs.pop(rid, None)
        if seq is None:
            return False
        self.pins.release(rid)
        if self._grammars is not None and self._grammars.remove(rid) is not None:
            seq.status = SeqStatus.FINISHED  # it never reached the scheduler
        else:
            self.scheduler.remove(seq)
        seq.finish_reason = "abort"
        self._aborted.append(rid)
        return True

    def has_work(self) -> bool:
        """Anything in flight, compiles included (see `ready` for what a step would act on now)."""
        return self.ready() or bool(self._grammars)

    def ready(self) -> bool:
        """A step would do something now: abort outputs, scheduled work, or a compile done or expired."""
        return bool(self._aborted) or self.scheduler.has_work() or (
            bool(self._grammars) and self._grammars.ready())  # type: ignore[union-attr]

    # ---- stepping ----

    def step(self) -> list[StepOutput]:
        """One step: schedule, run the model, postprocess (and aborts and grammars settled since the last)."""
        outputs = self._settle_arrivals()
        batch = self.scheduler.schedule()
        if self.pins:
            self.pins.admitted(batch)
        if batch.empty:
            return outputs
        self._steps += 1
        t = time.perf_counter()
        result = self.runner.run(batch)
        self.costs.stepped(batch, time.perf_counter() - t)
        if self.restorer is not None:
            self.restorer.stepped(batch, time.perf_counter() - t)
        return outputs + self._postprocess(batch, result)

    def _settle_arrivals(self) -> list[StepOutput]:
        outputs = [StepOutput(rid, [], "abort", 0, None) for rid in self._aborted]
        self._aborted.clear()
        if self._grammars:
            outputs += self._settle_grammars()
        return outputs

    def _postprocess(self, batch: ScheduledBatch, result: StepResult) -> list[StepOutput]:
        self._advance(batch)
        if self.exports.watched:
            self.exports.stepped(batch)  # before a finishing request releases its pages
        outputs = [self._sampled(i, seq, tok, result)
                   for i, (seq, tok) in enumerate(zip(result.sampled, result.tokens, strict=True))]
        outputs += [self._verify(seq, drafts, toks) for seq, drafts, toks in result.verified or ()]
        return outputs

    def _advance(self, batch: ScheduledBatch) -> None:
        """The KV cache now holds the step's decode and prefill tokens (verify chunks advance in
        `_verify`)."""
        for seq in batch.decodes:
            seq.num_computed += 1
        for seq, n in batch.prefills:
            seq.num_computed += n
            self._prefill_computed += n
            if seq.num_computed == len(seq.tokens):
                self.scheduler.publish(seq)

    def _sampled(self, i: int, seq: Sequence, tok: int, result: StepResult) -> StepOutput:
        out = self._append(seq, tok, None if result.logprobs is None else result.logprobs[i])
        k = seq.sampling.top_logprobs
        if k and result.top_ids is not None and result.top_logprobs is not None:
            out.top_ids = [result.top_ids[i][:k]] if out.new_tokens else []
            out.top_logprobs = [result.top_logprobs[i][:k]] if out.new_tokens else []
        return out

    def _verify(self, seq: Sequence, drafts: list[int], toks: list[int]) -> StepOutput:
        """Keep the drafts the target agreed with, then the target's own next token; cut at a stop rule.

        toks[j] is what plain decoding would have drawn after drafts[:j] (same logits row, same noise)."""
        a = 0
        while a < len(drafts) and toks[a] == drafts[a]:
            a += 1
        seq.num_computed += 1 + a  # K/V of the last token and the accepted drafts; the rest is rolled back
        spec = self._spec
        spec[0] += len(drafts)
        spec[1] += a
        spec[2] += 1
        new: list[int] = []
        reason = error = None
        for tok in toks[:a + 1]:
            emitted, reason, error = self._take(seq, tok)
            if emitted:
                new.append(tok)
            if reason is not None:
                break
        if reason is None:
            self.scheduler.spec_accepted(seq, a)
        return StepOutput(seq.rid, new, reason, seq.cached_tokens, None, error=error)

    def _take(self, seq: Sequence, tok: int) -> tuple[bool, str | None, RequestError | None]:
        """Apply a sampled token: (appended?, finish reason, error); a finished sequence leaves the engine."""
        self._generated += 1
        reason = error = None
        emitted = False
        if tok in seq.stop_ids:
            reason = "stop"
        elif seq.grammar is not None and not seq.grammar.accept(tok):
            log.error("grammar refused sampled token %d: %s", tok, seq.grammar.error,
                      extra={"request_id": seq.rid})
            reason = "error"
            error = RequestError("internal", "constrained decoding failed", retryable=False)
        else:
            seq.tokens.append(tok)
            emitted = True
            if seq.grammar is not None and seq.grammar.is_terminated():
                reason = "stop"  # the value is complete (takes precedence when max_tokens is reached with it)
            elif seq.num_output >= seq.sampling.max_tokens:
                reason = "length"
        if reason is not None:
            seq.finish_reason = reason
            # a verify run may end inside its drafts
            seq.num_computed = min(seq.num_computed, len(seq.tokens))
            self.scheduler.finish(seq)
            del self._seqs[seq.rid]
            self.pins.release(seq.rid)
        return emitted, reason, error

    def _append(self, seq: Sequence, tok: int, logprob: float | None) -> StepOutput:
        params = seq.sampling
        ok, reason, error = self._take(seq, tok)
        emitted = [tok] if ok else []
        lp = [logprob] if params.logprobs and emitted and logprob is not None else None
        if params.logprobs and lp is None:
            lp = []
        return StepOutput(seq.rid, emitted, reason, seq.cached_tokens, lp, error=error)

    def stats(self) -> EngineStats:
        bs = self.config.block_size
        sched, cache, free = self.scheduler, self.cache, self.pool.num_free
        evictable = cache.evictable_pages if cache is not None else 0
        looked_up, hit = sched.admitted_prompt_tokens, sched.cached_prompt_tokens
        return EngineStats(
            num_waiting=len(sched.waiting) + len(self._grammars or ()), num_running=len(sched.running),
            kv_free_tokens=(free + evictable) * bs, kv_total_tokens=self.pool.num_pages * bs,
            prefix_hit_rate=hit / looked_up if looked_up else 0.0,
            preemptions=sched.preemptions, prompt_tokens=self._prompt_tokens,
            prefill_tokens_computed=self._prefill_computed, generated_tokens=self._generated,
            steps=self._steps, cached_tokens=hit, free_pages=free, evictable_pages=evictable,
            cached_pages=cache.cached_pages if cache is not None else 0,
            locked_pages=cache.locked_pages if cache is not None else 0,
            evicted_pages=cache.evicted_pages if cache is not None else 0,
            quantization=self.loaded.quantization, attention_backend=self.runner.attn.name,
            cuda_graphs=self.runner.graphs is not None,
            prefill_attention=getattr(self.runner.attn, "prefill_path", ""),
            spec_proposed_tokens=self._spec[0], spec_accepted_tokens=self._spec[1],
            spec_verify_steps=self._spec[2],
            tiers=self.restorer.tiers.snapshot_stats() if self.restorer is not None else None,
            prefill_tps=self.costs.prefill_tps, step_s=self.costs.step_s,
            prefill_backlog=sched.prefill_backlog(),
        )

    # ---- convenience ----

    def generate(self, prompts: list[list[int]],
                 sampling: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion (blocking); returns generated ids per prompt (stop token excluded).

        Drives step() itself: outputs of other requests in the engine are dropped, so do not mix
        it with a caller that streams from step()."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if len(params) != len(prompts):
            raise bad_request("one SamplingParams per prompt", "sampling")
        rids = [f"gen-{self._arrivals}-{i}" for i in range(len(prompts))]
        added: list[str] = []
        try:
            for rid, p, sp in zip(rids, prompts, params, strict=True):
                self.add_request(rid, p, sp)
                added.append(rid)
            results: dict[str, list[int]] = {rid: [] for rid in rids}
            pending = set(rids)
            while pending:
                if not self.ready() and self._grammars:
                    self._grammars.wait(0.05)
                for out in self.step():
                    if out.rid in results:
                        results[out.rid].extend(out.new_tokens)
                        if out.finish_reason is not None:
                            pending.discard(out.rid)
            return [results[r] for r in rids]
        finally:
            for rid in added:
                if rid in self._seqs:
                    self.abort(rid)

    def is_running(self, rid: str) -> bool:
        seq = self._seqs.get(rid)
        return seq is not None and seq.status != SeqStatus.FINISHED
