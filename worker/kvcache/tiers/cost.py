"""When restoring pages beats recomputing them: measured restore and disk bytes/s against prefill tokens/s."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

# tokens/s before any prefill is measured: above every CPU we run on, so cautious
PREFILL_PRIOR_TPS = 20_000.0
DISK_PRIOR_BPS = 200e6  # bytes/s before any disk read is measured (a slow SSD)
ALPHA = 0.2  # weight of the newest sample in each moving average


@dataclass(slots=True)
class Rate:
    """An exponentially weighted moving average of amount per second."""

    value: float
    samples: int = 0

    def add(self, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return
        x = amount / seconds
        self.value = x if self.samples == 0 else (1 - ALPHA) * self.value + ALPHA * x
        self.samples += 1


class CostModel:
    """`worth(...)`: the load takes less time than the prefill of the same tokens would."""

    def __init__(self, page_bytes: int) -> None:
        self.restore = Rate(measure_copy_bps(page_bytes))  # host rows into the KV tensors
        self.disk = Rate(DISK_PRIOR_BPS)
        self.prefill = Rate(PREFILL_PRIOR_TPS)

    def load_seconds(self, ram_bytes: int, disk_bytes: int) -> float:
        return (ram_bytes + disk_bytes) / self.restore.value + disk_bytes / self.disk.value

    def worth(self, ram_bytes: int, disk_bytes: int, tokens: int) -> bool:
        return self.load_seconds(ram_bytes, disk_bytes) < tokens / self.prefill.value


def measure_copy_bps(page_bytes: int, pages: int = 64) -> float:
    """Bytes/s of copying `pages` pages between two host buffers (the startup prior of the restore rate)."""
    src = torch.ones(max(1, page_bytes) * pages, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return src.numel() / max(best, 1e-7)
