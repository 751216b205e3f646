"""Decode steps as replayed CUDA graphs: one graph per batch-size bucket, padded, all sharing one memory pool.

Padded rows carry context length 0 and slot -1, so the Triton kernels skip them; the eager forward is the
reference.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from worker.kvcache.tensors import KVCache
from worker.model.attention import padded_table
from worker.model.llama import LlamaModel, StepContext
from worker.model.triton_backend import TritonAttention, TritonMeta

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass(slots=True)
class DecodeInputs:
    """One decode step on the host: per sequence its token, position, cache slot, pages and context length."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    tables: list[list[int]]
    lens: list[int]


def buckets_for(max_batch: int) -> list[int]:
    return [b for b in BUCKETS if b < max_batch] + [max_batch]


class DecodeGraphs:
    """Static input buffers sized for the largest bucket; each bucket's graph reads their first rows."""

    def __init__(self, model: LlamaModel, attn: TritonAttention, kv: KVCache, ops, max_batch: int,
                 max_pages: int, device: torch.device) -> None:
        self.model, self.attn, self.kv, self.ops = model, attn, kv, ops
        self.buckets = buckets_for(max_batch)
        self.max_pages = max_pages
        b = self.buckets[-1]
        self.ids = torch.zeros(b, dtype=torch.int64, device=device)
        self.pos = torch.zeros(b, dtype=torch.int64, device=device)
        self.slots = torch.full((b,), -1, dtype=torch.int64, device=device)
        self.tables = torch.zeros(b, max_pages, dtype=torch.int32, device=device)
        self.lens = torch.zeros(b, dtype=torch.int32, device=device)
        self.rows = torch.arange(b, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _context(self, b: int) -> StepContext:
        meta = TritonMeta(self.slots[:b], b, self.tables[:b], self.lens[:b])
        return StepContext(self.pos[:b], self.rows[:b], self.attn, meta, self.kv, self.ops)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for b in reversed(self.buckets):  # largest first: the pool's blocks then fit the smaller ones
            ctx = self._context(b)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compiles the kernels and settles the allocator outside the capture
                    self.model(self.ids[:b], ctx)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model(self.ids[:b], ctx)
            self.graphs[b] = (graph, logits)
        torch.cuda.synchronize()
        log.info("captured %d decode CUDA graphs (batch %s) in %.1fs", len(self.graphs), self.buckets,
                 time.monotonic() - t0)

    def bucket(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def fits(self, inputs: DecodeInputs) -> bool:
        n = len(inputs.ids)
        return 0 < n <= self.buckets[-1] and max(len(t) for t in inputs.tables) <= self.max_pages

    def run(self, inputs: DecodeInputs) -> torch.Tensor:
        """fp32 logits [n, vocab] of the step (a view into the graph's output: read it before the next
        run)."""
        n = len(inputs.ids)
        b = self.bucket(n)
        host = torch.tensor([inputs.ids, inputs.positions, inputs.slots, inputs.lens], dtype=torch.int64)
        table = padded_table(inputs.tables, torch.int32)
        self.ids[:n].copy_(host[0], non_blocking=True)
        self.pos[:n].copy_(host[1], non_blocking=True)
        self.slots[:n].copy_(host[2], non_blocking=True)
        self.lens[:n].copy_(host[3], non_blocking=True)
        self.tables[:n, :table.shape[1]].copy_(table, non_blocking=True)
        if b > n:  # padded rows: no context, no cache write
            self.lens[n:b].zero_()
            self.slots[n:b].fill_(-1)
        graph, logits = self.graphs[b]
        graph.replay()
        return logits[:n]
