"""Page accounting for the paged KV cache: a free list with reference counts.

A page shared by several sequences and the radix cache returns to the free list with its last reference.
"""

from __future__ import annotations

from collections import deque


def pages_for(tokens: int, block_size: int) -> int:
    """Pages that hold `tokens` tokens at `block_size` a page."""
    return -(-tokens // block_size)


class OutOfPages(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""


class PagePool:
    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError("num_pages must be positive")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refs: list[int] = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, n: int) -> list[int]:
        """Take `n` free pages, each with one reference owned by the caller."""
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        """Add one reference to each page (a new holder of already-used pages)."""
        for p in pages:
            assert self._refs[p] > 0, f"retain of free page {p}"
            self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference from each page; pages reaching zero become free."""
        for p in pages:
            assert self._refs[p] > 0, f"double free of page {p}"
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def all_free(self) -> bool:
        """True when every page is back in the free list (leak check for tests)."""
        return len(self._free) == self.num_pages and not any(self._refs)
