"""Disaggregated prefill, prefill side: the full pages of watched requests, read out of the KV cache as each
prefill chunk computes them (before a finished request can release them), for the server to push.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.engine.records.sequence import ScheduledBatch
from worker.kvcache.tiers.pages import PageCodec


@dataclass(slots=True)
class Watched:
    next_block: int  # first block not read out yet
    end_block: int  # one past the last block to read out (the prompt's full blocks)


@dataclass(slots=True)
class ReadyPages:
    rid: str
    first_block: int
    rows: torch.Tensor  # [n, page_bytes] uint8 on the host


@dataclass(slots=True)
class PageExport:
    codec: PageCodec
    block_size: int
    watched: dict[str, Watched] = field(default_factory=dict)
    ready: list[ReadyPages] = field(default_factory=list)

    def watch(self, rid: str, first_block: int, end_block: int) -> None:
        """Read out blocks [first_block, end_block) of request `rid` as its prefill computes them."""
        self.watched[rid] = Watched(first_block, end_block)

    def forget(self, rid: str) -> None:
        self.watched.pop(rid, None)
        self.ready = [r for r in self.ready if r.rid != rid]

    def stepped(self, batch: ScheduledBatch) -> None:
        """After a step advanced its prefills: copy out each watched request's newly completed blocks."""
        for seq, _ in batch.prefills:
            w = self.watched.get(seq.rid)
            if w is None:
                continue
            done = min(seq.num_computed // self.block_size, w.end_block)
            if done > w.next_block:
                self.ready.append(ReadyPages(seq.rid, w.next_block,
                                             self.codec.read(seq.pages[w.next_block:done])))
                w.next_block = done

    def take(self) -> list[ReadyPages]:
        ready, self.ready = self.ready, []
        return ready
