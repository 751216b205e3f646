"""Model runner: turns a `ScheduledBatch` into one forward over the flattened step and samples it.

Preparing a step costs O(sequences) Python work plus a few vectorized tensor ops.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from worker.config import EngineConfig
from worker.engine.records.sequence import ScheduledBatch, Sequence
from worker.kvcache.tensors import KVCache
from worker.model.attention import BatchLayout
from worker.model.backends import make_backend, make_ops
from worker.model.cuda_graphs import DecodeGraphs, DecodeInputs
from worker.model.decode_stack import DecodeStack
from worker.model.kv_dtype import resolve_kv_dtype
from worker.model.llama import StepContext
from worker.model.loader import LoadedModel
from worker.model.prefill_choice import choose_prefill
from worker.sample.grammar import BatchMasker
from worker.sample.logit_adjust import build_adjust
from worker.sample.sampler import SamplingBatch, sample

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepResult:
    sampled: list[Sequence]  # sequences that got a new token, in order
    tokens: list[int]
    logprobs: list[float] | None
    top_ids: list[list[int]] | None = None  # per sampled row, the k most likely token ids
    top_logprobs: list[list[float]] | None = None
    # speculative verification: (sequence, drafts, the target's token at each of the 1 + len(drafts) rows)
    verified: list[tuple[Sequence, list[int], list[int]]] | None = None


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, num_pages: int) -> None:
        cfg = loaded.config
        self.model = loaded.model
        self.device = loaded.device
        self.bs = config.block_size
        self.attn = make_backend(config.attention_backend, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                 config.block_size, loaded.device)
        self.kv = KVCache(cfg, num_pages, config.block_size, loaded.dtype, loaded.device,
                          pages_first=self.attn.pages_first,
                          kv_dtype=resolve_kv_dtype(config, loaded.device)[0])
        self.attn = choose_prefill(self.attn, cfg, self.kv)
        self.masker: BatchMasker | None = None  # set by the engine with its first grammar request
        self.ops = make_ops(config.fused_ops == "on", loaded.device, loaded.dtype,
                            fused_linear=config.fused_linear == "on")
        self.stack = DecodeStack.build(self.model, self.attn, self.kv, self.ops)
        self.graphs = self._capture_graphs(loaded, config)

    def _capture_graphs(self, loaded: LoadedModel, config: EngineConfig) -> DecodeGraphs | None:
        """Decode CUDA graphs (`worker.model.cuda_graphs`) on CUDA with the Triton backend, unless turned
        off."""
        if config.cuda_graphs != "on" or self.device.type != "cuda":
            return None
        if self.attn.name != "triton":
            log.info("CUDA graphs need the triton attention backend (have %s): decode runs eagerly",
                     self.attn.name)
            return None
        graphs = DecodeGraphs(self.model, self.attn, self.kv, self.ops, config.max_num_seqs,
                              -(-loaded.max_context // self.bs), self.device)
        graphs.capture()
        return graphs

    def run(self, batch: ScheduledBatch) -> StepResult:
        with torch.inference_mode():
            logits, sampled = self._forward(batch)
            n = len(sampled)
            rows, steps = spec_rows(sampled, batch.verifies)
            if not rows:
                return StepResult([], [], None)
            sb = self._sampling_batch(rows, steps, self.device, logits.shape[-1])
            if self.masker is not None:
                sb.grammar_mask = self.masker.fill([s.grammar for s in rows])
            out = sample(logits, sb)
        tokens = out.tokens.tolist()
        verified = split_verified(batch.verifies, tokens, n) if batch.verifies else None
        lp = out.logprobs[:n].tolist() if out.logprobs is not None else None
        if out.top_ids is None:
            return StepResult(sampled, tokens[:n], lp, verified=verified)
        return StepResult(sampled, tokens[:n], lp, out.top_ids[:n].tolist(), out.top_logprobs[:n].tolist(),
                          verified)

    def _forward(self, batch: ScheduledBatch) -> tuple[torch.Tensor | None, list[Sequence]]:
        """Logits of the step and the sequences that sample: a graph replay for a decode-only step that fits
        one."""
        if self.graphs is not None and batch.decodes and not batch.prefills and not batch.verifies:
            inputs = decode_inputs(batch.decodes, self.bs)
            if self.graphs.fits(inputs):
                return self.graphs.run(inputs), list(batch.decodes)
        input_ids, ctx, sampled = self.prepare(batch)
        return self.logits(input_ids, ctx), sampled

    def logits(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor | None:
        """fp32 logits of the rows that sample, None when none does."""
        return self.model(input_ids, ctx)

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, StepContext, list[Sequence]]:
        """Token ids (decodes, verify chunks, prefill chunks), the step context, and the sequences that
        sample.

        Logit rows: decodes and sampling prefills in `sampled` order, then every row of the verify chunks."""
        bs = self.bs
        dec = decode_inputs(batch.decodes, bs)
        ids: list[int] = dec.ids
        positions: list[torch.Tensor] = [torch.tensor(dec.positions, dtype=torch.int64)]
        slots: list[torch.Tensor] = [torch.tensor(dec.slots, dtype=torch.int64)]
        sampled = list(batch.decodes)
        rows = list(range(len(batch.decodes)))
        row = len(batch.decodes)
        pf_tables, pf_q, pf_ctx = [], [], []
        spec: list[int] = []  # verify chunks run like prefill chunks; their rows sample after all others
        chunks = ([(seq, 1 + len(d), d) for seq, d in batch.verifies]
                  + [(seq, n, None) for seq, n in batch.prefills])
        for seq, n, drafts in chunks:
            start = seq.num_computed
            if drafts is None:
                ids.extend(seq.tokens[start:start + n])
            else:
                ids.append(seq.tokens[start])
                ids.extend(drafts)
                spec.extend(range(row, row + n))
            pos = torch.arange(start, start + n)
            positions.append(pos)
            first_page, last_page = start // bs, (start + n - 1) // bs
            pages = torch.tensor(seq.pages[first_page:last_page + 1], dtype=torch.int64)
            slots.append(pages[pos // bs - first_page] * bs + pos % bs)
            pf_tables.append(seq.pages)
            pf_q.append(n)
            pf_ctx.append(start + n)
            row += n
            if drafts is None and start + n == len(seq.tokens):
                sampled.append(seq)
                rows.append(row - 1)
        rows += spec
        dev = self.device
        lay = BatchLayout(bs, torch.cat(slots).to(dev), dec.tables, dec.lens, pf_tables, pf_q, pf_ctx)
        meta = self.attn.prepare(lay, dev)
        input_ids = torch.tensor(ids, dtype=torch.int64).to(dev)
        pos_t = torch.cat(positions).to(dev)
        rows_t = torch.tensor(rows, dtype=torch.int64).to(dev)
        return input_ids, StepContext(pos_t, rows_t, self.attn, meta, self.kv, self.ops, self.stack), sampled

    @staticmethod
    def _sampling_batch(seqs: list[Sequence], steps: list[int] | None, dev: torch.device,
                        vocab: int) -> SamplingBatch:
        """`steps`: the output index each row draws (default: each sequence's next)."""
        params = [s.sampling for s in seqs]
        all_greedy = all(p.greedy for p in params)
        want_lp = any(p.logprobs for p in params)
        top = min(max(p.top_logprobs for p in params), vocab)
        adjust = build_adjust(seqs, vocab, dev)
        if all_greedy:
            empty = torch.empty(0)
            return SamplingBatch(empty, empty, empty, empty, empty, True, False, False, want_lp, top, adjust)
        temp = torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        seed = torch.tensor([s.seed & 0xFFFFFFFF for s in seqs], dtype=torch.int64)
        hi = [s.seed >> 32 for s in seqs]
        seed_hi = torch.tensor(hi, dtype=torch.int64, device=dev) if any(hi) else None
        step = torch.tensor(steps if steps is not None else [s.num_output for s in seqs], dtype=torch.int64)
        return SamplingBatch(temp.to(dev), top_k.to(dev), top_p.to(dev), seed.to(dev), step.to(dev), False,
                             bool((top_k > 0).any()), bool((top_p < 1).any()), want_lp, top, adjust, seed_hi)


def decode_inputs(decodes: list[Sequence], bs: int) -> DecodeInputs:
    """Each decoding sequence's next token, its position and cache slot, its pages and context length."""
    ids, pos, slots, lens = [], [], [], []
    for seq in decodes:
        p = seq.num_computed
        ids.append(seq.tokens[p])
        pos.append(p)
        slots.append(seq.pages[p // bs] * bs + p % bs)
        lens.append(p + 1)
    return DecodeInputs(ids, pos, slots, [s.pages for s in decodes], lens)


def spec_rows(sampled: list[Sequence], verifies: list[tuple[Sequence, list[int]]]
              ) -> tuple[list[Sequence], list[int] | None]:
    """Per logit row: its sequence and the output index it draws (None: each sequence's next, no verifies).

    Verify row j of a sequence draws output index num_output + j with the same (seed, step) noise as plain
    decoding, so a verified token is exactly the token plain decoding would sample there."""
    if not verifies:
        return sampled, None
    rows, steps = list(sampled), [s.num_output for s in sampled]
    for seq, drafts in verifies:
        rows.extend([seq] * (1 + len(drafts)))
        steps.extend(range(seq.num_output, seq.num_output + 1 + len(drafts)))
    return rows, steps


def split_verified(verifies: list[tuple[Sequence, list[int]]], tokens: list[int], start: int
                   ) -> list[tuple[Sequence, list[int], list[int]]]:
    out = []
    for seq, drafts in verifies:
        end = start + 1 + len(drafts)
        out.append((seq, drafts, tokens[start:end]))
        start = end
    return out
