"""Per-request logit changes applied in the batched sampler: penalties, logit bias, min_tokens bans.

Built only for the rows that ask for them, so a step where no request does pays nothing.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.nn.utils.rnn import pad_sequence

from worker.protocol import SamplingParams


class Adjusted(Protocol):
    """What `build_adjust` reads of a request: the engine's `Sequence` (a floor above) has these."""

    prompt_len: int
    sampling: SamplingParams
    stop_ids: Collection[int]
    tokens: list[int]

    @property
    def num_output(self) -> int: ...


@dataclass(slots=True)
class LogitAdjust:
    """Sparse additions (bias, -inf bans) and dense penalties over a few rows of the step's logits."""

    add_rows: torch.Tensor  # [m] int64
    add_ids: torch.Tensor  # [m] int64
    add_vals: torch.Tensor  # [m] float32 (-inf bans a token)
    pen_rows: torch.Tensor  # [r] int64: rows with a penalty
    out_ids: torch.Tensor  # [r, L] int64: generated tokens, padded with vocab
    seen_ids: torch.Tensor | None  # [r, L'] int64: prompt + generated tokens (repetition penalty), padded
    presence: torch.Tensor  # [r] float32
    frequency: torch.Tensor  # [r] float32
    repetition: torch.Tensor  # [r] float32

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A new tensor: logits with penalties (vLLM order: repetition, then frequency and presence) and
        additions."""
        out = logits.clone()
        if len(self.pen_rows):
            out[self.pen_rows] = self._penalized(out[self.pen_rows])
        if len(self.add_rows):
            out.index_put_((self.add_rows, self.add_ids), self.add_vals, accumulate=True)
        return out

    def _penalized(self, rows: torch.Tensor) -> torch.Tensor:
        vocab = rows.shape[-1]
        if self.seen_ids is not None:
            seen = torch.zeros(rows.shape[0], vocab + 1, dtype=torch.bool, device=rows.device)
            seen.scatter_(1, self.seen_ids, True)
            rep = self.repetition[:, None]
            rows = torch.where(seen[:, :vocab], torch.where(rows > 0, rows / rep, rows * rep), rows)
        counts = torch.zeros(rows.shape[0], vocab + 1, dtype=rows.dtype, device=rows.device)
        counts.scatter_add_(1, self.out_ids, torch.ones_like(self.out_ids, dtype=rows.dtype))
        counts = counts[:, :vocab]
        return rows - self.frequency[:, None] * counts - self.presence[:, None] * (counts > 0).to(rows.dtype)


def build_adjust(seqs: list[Adjusted], vocab: int, dev: torch.device) -> LogitAdjust | None:
    """The step's adjustments, or None when no row uses any (the fast path)."""
    adds: list[tuple[int, int, float]] = []
    pen: list[int] = []
    for row, seq in enumerate(seqs):
        p = seq.sampling
        adds += [(row, tok, bias) for tok, bias in p.logit_bias]
        if seq.num_output < p.min_tokens:
            adds += [(row, tok, float("-inf")) for tok in seq.stop_ids]
        if p.penalized:
            pen.append(row)
    if not adds and not pen:
        return None
    add_rows, add_ids, add_vals = (list(col) for col in zip(*adds, strict=True)) if adds else ([], [], [])
    params = [seqs[r].sampling for r in pen]

    def padded(lists: list[list[int]]) -> torch.Tensor:
        rows = [torch.tensor(x + [vocab], dtype=torch.int64) for x in lists] or [torch.tensor([vocab])]
        return pad_sequence(rows, batch_first=True, padding_value=vocab)[:len(lists)].to(dev)

    def floats(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=dev)

    any_rep = any(p.repetition_penalty != 1.0 for p in params)
    return LogitAdjust(
        torch.tensor(add_rows, dtype=torch.int64, device=dev),
        torch.tensor(add_ids, dtype=torch.int64, device=dev), floats(add_vals),
        torch.tensor(pen, dtype=torch.int64, device=dev),
        padded([seqs[r].tokens[seqs[r].prompt_len:] for r in pen]),
        padded([seqs[r].tokens for r in pen]) if any_rep else None,
        floats([p.presence_penalty for p in params]), floats([p.frequency_penalty for p in params]),
        floats([p.repetition_penalty for p in params]))
