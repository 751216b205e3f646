"""Radix prefix cache: a hypothesis state machine against a plain reference model
(matches, lock counts, locked pages never evicted, page conservation)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tests.worker.kvcache.test_radix_cache import NS_A, NS_B
from worker.kvcache.page_pool import PagePool
from worker.kvcache.radix_cache import PrefixMatch, RadixCache


class ReferenceCache:
    """Plain model: {ns: {page-aligned prefix: page}} plus per-entry access time, LRU by page."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.entries: dict[bytes, dict[tuple[int, ...], int]] = {}
        self.access: dict[tuple[bytes, tuple[int, ...]], int] = {}
        self.clock = 0

    def match(self, ns: bytes, toks: tuple[int, ...]) -> list[int]:
        ents, pages = self.entries.get(ns, {}), []
        while (len(pages) + 1) * self.bs <= len(toks) and toks[: (len(pages) + 1) * self.bs] in ents:
            pages.append(ents[toks[: (len(pages) + 1) * self.bs]])
        return pages

    def touch(self, ns: bytes, toks: tuple[int, ...], n_pages: int) -> None:
        self.clock += 1
        for j in range(1, n_pages + 1):
            self.access[(ns, toks[: j * self.bs])] = self.clock

    def insert(self, ns: bytes, toks: tuple[int, ...], pages: list[int]) -> tuple[int, list[int]]:
        """Returns (newly cached tokens, the caller's pages that were duplicates)."""
        n_full = len(toks) // self.bs
        if n_full == 0:
            return 0, []
        ents = self.entries.setdefault(ns, {})
        new, dups = 0, []
        for j in range(1, n_full + 1):
            prefix = toks[: j * self.bs]
            if prefix in ents:
                dups.append(pages[j - 1])
            else:
                ents[prefix] = pages[j - 1]
                new += self.bs
        self.touch(ns, toks, n_full)
        return new, dups

    def evict(self, n: int, locked: set[tuple[bytes, tuple[int, ...]]]) -> list[int]:
        freed: list[int] = []
        while len(freed) < n:
            leaves = []
            for ns, ents in self.entries.items():
                parents = {k[: -self.bs] for k in ents}
                leaves += [(self.access[(ns, k)], ns, k) for k in ents if k not in parents
                           and (ns, k) not in locked]
            if not leaves:
                break
            leaves.sort()
            assert len(leaves) == 1 or leaves[0][0] != leaves[1][0], "LRU tie in the reference"
            _, ns, k = leaves[0]
            freed.append(self.entries[ns].pop(k))
            del self.access[(ns, k)]
            if not self.entries[ns]:
                del self.entries[ns]
        return freed


@dataclass(slots=True)
class SimSeq:
    ns: bytes
    tokens: tuple[int, ...]
    match: PrefixMatch
    pages: list[int]  # one pool reference each, owned by this sequence


namespaces = st.sampled_from([NS_A, NS_A, NS_A, NS_B])  # mostly one, so prefixes meet
# Prompts are a shared base (system prompts that fork from each other) cut anywhere, plus a
# short random tail, so prefixes collide at every depth and page boundary.
BASES = (
    (0, 0, 1, 1, 2, 2, 0, 1, 2, 0, 1, 2, 2, 1),
    (0, 0, 1, 1, 2, 2, 2, 2, 1, 1, 0, 0, 1, 2),
    (0, 0, 1, 2, 0, 0, 1, 2, 0, 0, 1, 2, 0, 0),
    (1, 2, 1, 2, 1, 2, 1, 2, 0, 0, 0, 0, 1, 1),
)
token_lists = st.one_of(
    st.lists(st.integers(0, 2), min_size=1, max_size=8),
    st.builds(
        lambda base, cut, tail: list(base[:cut]) + tail,
        st.sampled_from(BASES), st.integers(1, 14), st.lists(st.integers(0, 2), max_size=4),
    ),
    st.sampled_from(BASES).map(list),
)


class RadixMachine(RuleBasedStateMachine):
    @initialize(block_size=st.integers(2, 4), num_pages=st.integers(6, 64))
    def setup(self, block_size: int, num_pages: int) -> None:
        self.bs = block_size
        self.pool = PagePool(num_pages)
        self.cache = RadixCache(self.pool, block_size)
        self.ref = ReferenceCache(block_size)
        self.seqs: list[SimSeq] = []
        self.hits = self.lookups = 0

    def locked(self) -> set[tuple[bytes, tuple[int, ...]]]:
        return {(s.ns, s.tokens[: j * self.bs]) for s in self.seqs for j in range(1, len(s.match.pages) + 1)}

    def evict_both(self, n: int) -> None:
        expected = self.ref.evict(n, self.locked())
        assert self.cache.evict(n) == len(expected)

    def get_pages(self, n: int) -> list[int] | None:
        """Allocate like a scheduler: evict on shortage; None if the memory is locked."""
        if n > self.pool.num_free:
            self.evict_both(n - self.pool.num_free)
        return self.pool.allocate(n) if n <= self.pool.num_free else None

    @rule(ns=namespaces, toks=token_lists)
    def match(self, ns: bytes, toks: list[int]) -> None:
        t = tuple(toks)
        expected = self.ref.match(ns, t)
        assert self.cache.peek(ns, toks) == len(expected) * self.bs
        m = self.cache.match_prefix(ns, toks)
        assert m.pages == expected and m.num_tokens == len(expected) * self.bs
        if expected:
            self.ref.touch(ns, t, len(expected))
        self.hits += m.num_tokens
        self.lookups += len(toks)
        self.seqs.append(SimSeq(ns, t, m, list(m.pages)))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def match_related(self, data: st.DataObject) -> None:
        """A prompt forking from a running one: splits nodes that are locked right now."""
        seq = self.seqs[data.draw(st.integers(0, len(self.seqs) - 1))]
        cut = data.draw(st.integers(1, len(seq.tokens)))
        self.match(seq.ns, list(seq.tokens[:cut]) + data.draw(st.lists(st.integers(0, 2), max_size=6)))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish_or_preempt(self, data: st.DataObject) -> None:
        seq = self.seqs[data.draw(st.integers(0, len(self.seqs) - 1))]
        computed = data.draw(st.integers(seq.match.num_tokens, len(seq.tokens)))
        extra = self.get_pages(-(-computed // self.bs) - len(seq.pages))
        if extra is None or computed == 0:
            self.abort_seq(seq)
            return
        seq.pages += extra
        toks = seq.tokens[:computed]
        new, dups = self.ref.insert(seq.ns, toks, seq.pages)
        assert self.cache.insert(seq.ns, toks, seq.pages) == new
        assert all(self.pool.refcount(p) == 0 for p in dups if p not in seq.match.pages)
        self.pool.release(seq.pages[computed // self.bs:])
        self.cache.unlock(seq.match.handle)
        self.seqs.remove(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self.abort_seq(self.seqs[data.draw(st.integers(0, len(self.seqs) - 1))])

    def abort_seq(self, seq: SimSeq) -> None:
        self.pool.release(seq.pages)
        self.cache.unlock(seq.match.handle)
        self.seqs.remove(seq)

    @rule(ns=namespaces, toks=token_lists)
    def insert_unmatched(self, ns: bytes, toks: list[int]) -> None:
        """A sequence that computed everything itself (e.g. raced a twin): its pages may be duplicates."""
        pages = self.get_pages(-(-len(toks) // self.bs))
        if pages is None:
            return
        new, _ = self.ref.insert(ns, tuple(toks), pages)
        assert self.cache.insert(ns, toks, pages) == new
        self.pool.release(pages[len(toks) // self.bs:])

    @rule(n=st.integers(0, 3))
    def evict(self, n: int) -> None:
        self.evict_both(n)

    @invariant()
    def agrees_with_reference(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check_invariants()
        assert self.cache.snapshot() == self.ref.entries
        locked = self.locked()
        assert all(k in self.ref.entries.get(ns, {}) for ns, k in locked), "a locked page was evicted"
        assert self.cache.locked_pages == len(locked)
        assert self.cache.hit_tokens == self.hits and self.cache.lookup_tokens == self.lookups

    @invariant()
    def pages_conserved(self) -> None:
        if not hasattr(self, "cache"):
            return
        expected = [0] * self.pool.num_pages
        for ents in self.ref.entries.values():
            for p in ents.values():
                expected[p] += 1
        for s in self.seqs:
            for p in s.pages:
                expected[p] += 1
        assert [self.pool.refcount(p) for p in range(self.pool.num_pages)] == expected
        assert self.pool.num_free == expected.count(0)


RadixMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_radix_cache_matches_reference = RadixMachine.TestCase
