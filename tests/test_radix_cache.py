"""Radix prefix cache: unit tests and a hypothesis state machine against a plain reference model."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from worker.page_pool import PagePool
from worker.radix_cache import PrefixMatch, RadixCache

NS_A, NS_B = b"model|v1|tenant-a", b"model|v1|tenant-b"


def make(num_pages: int = 16, block_size: int = 2) -> tuple[PagePool, RadixCache]:
    pool = PagePool(num_pages)
    return pool, RadixCache(pool, block_size)


def run_and_insert(pool: PagePool, cache: RadixCache, ns: bytes, tokens: list[int]) -> PrefixMatch:
    """Simulate a sequence: match, allocate the rest, insert everything, release the tail, unlock."""
    m = cache.match_prefix(ns, tokens)
    bs = cache.block_size
    pages = m.pages + pool.allocate(-(-len(tokens) // bs) - len(m.pages))
    cache.insert(ns, tokens, pages)
    pool.release(pages[len(tokens) // bs:])
    cache.unlock(m.handle)
    return m


# ----- unit tests ---------------------------------------------------------------------------


def test_match_reuses_inserted_pages_and_counts_hits() -> None:
    pool, cache = make()
    first = run_and_insert(pool, cache, NS_A, [1, 2, 3, 4, 5])
    assert first.num_tokens == 0 and first.handle is None
    assert cache.cached_pages == 2 and pool.num_free == 14  # the partial page was released

    m = cache.match_prefix(NS_A, [1, 2, 3, 4, 9])
    assert m.num_tokens == 4 and len(m.pages) == 2
    assert all(pool.refcount(p) == 2 for p in m.pages)  # the tree's ref and the caller's
    assert cache.locked_pages == 2 and cache.evictable_pages == 0
    assert cache.hit_tokens == 4 and cache.lookup_tokens == 10 and cache.hit_rate == pytest.approx(0.4)
    pool.release(m.pages)
    cache.unlock(m.handle)
    assert cache.locked_pages == 0 and cache.evictable_pages == 2
    cache.check_invariants()


def test_namespaces_never_share_nodes() -> None:
    pool, cache = make()
    run_and_insert(pool, cache, NS_A, [7, 7, 8, 8])
    assert cache.peek(NS_A, [7, 7, 8, 8]) == 4
    m = cache.match_prefix(NS_B, [7, 7, 8, 8])
    assert m.num_tokens == 0 and m.pages == []
    run_and_insert(pool, cache, NS_B, [7, 7, 8, 8])
    snap = cache.snapshot()
    assert set(snap[NS_A].values()).isdisjoint(snap[NS_B].values())
    assert cache.cached_pages == 4
    cache.check_invariants()


def test_duplicate_insert_releases_the_callers_pages() -> None:
    pool, cache = make()
    run_and_insert(pool, cache, NS_A, [1, 1, 2, 2])
    # A second sequence that computed the same prompt without a match (ran concurrently).
    pages = pool.allocate(3)
    assert cache.insert(NS_A, [1, 1, 2, 2, 3, 3], pages) == 2
    assert pool.refcount(pages[0]) == 0 and pool.refcount(pages[1]) == 0  # duplicates freed
    assert pool.refcount(pages[2]) == 1 and cache.cached_pages == 3  # new page now the tree's
    cache.check_invariants()


def test_insert_splits_at_page_boundaries() -> None:
    pool, cache = make(block_size=2)
    run_and_insert(pool, cache, NS_A, [1, 2, 3, 4, 5, 6])  # one node, three pages
    run_and_insert(pool, cache, NS_A, [1, 2, 3, 4, 9, 9, 9, 9])  # diverges after two pages
    snap = cache.snapshot()[NS_A]
    assert sorted(len(k) for k in snap) == [2, 4, 6, 6, 8]
    assert cache.peek(NS_A, [1, 2, 3, 4, 5, 6]) == 6
    assert cache.peek(NS_A, [1, 2, 3, 4, 9, 9, 9, 9]) == 8
    assert cache.peek(NS_A, [1, 2, 3, 5]) == 2  # a mismatch inside a page stops at its start
    cache.check_invariants()


def test_match_splits_and_locks_only_the_matched_pages() -> None:
    pool, cache = make(block_size=2)
    run_and_insert(pool, cache, NS_A, [1, 2, 3, 4, 5, 6])
    m = cache.match_prefix(NS_A, [1, 2, 3, 4, 0, 0])
    assert m.num_tokens == 4 and cache.locked_pages == 2 and cache.evictable_pages == 1
    assert cache.evict(5) == 1  # only the unmatched tail page can go
    assert cache.peek(NS_A, [1, 2, 3, 4, 5, 6]) == 4
    pool.release(m.pages)
    cache.unlock(m.handle)
    assert cache.evict(5) == 2 and pool.all_free()
    cache.check_invariants()


def test_splitting_a_locked_node_keeps_both_parts_locked() -> None:
    pool, cache = make(block_size=2)
    run_and_insert(pool, cache, NS_A, [1, 2, 3, 4, 5, 6])
    held = cache.match_prefix(NS_A, [1, 2, 3, 4, 5, 6])  # locks the whole three-page node
    fork = cache.match_prefix(NS_A, [1, 2, 9, 9])  # splits it after the first page
    assert fork.num_tokens == 2 and fork.pages == held.pages[:1]
    assert cache.locked_pages == 3
    pool.release(fork.pages)
    cache.unlock(fork.handle)
    assert cache.locked_pages == 3 and cache.evict(10) == 0
    pool.release(held.pages)
    cache.unlock(held.handle)
    assert cache.evict(10) == 3 and pool.all_free()
    cache.check_invariants()


def test_evict_is_lru_and_trims_leaves_to_whole_pages() -> None:
    pool, cache = make(block_size=2)
    run_and_insert(pool, cache, NS_A, [1, 1, 1, 1, 1, 1])  # oldest
    run_and_insert(pool, cache, NS_B, [2, 2, 2, 2])
    run_and_insert(pool, cache, NS_A, [3, 3, 3, 3])
    m = cache.match_prefix(NS_A, [1, 1])  # touches only the first page of the oldest
    pool.release(m.pages)
    cache.unlock(m.handle)
    # LRU leaf is now the tail of [1]*6 (pages 2 and 3), then the namespace-B leaf.
    assert cache.evict(1) == 1
    assert cache.peek(NS_A, [1] * 6) == 4
    assert cache.evict(3) == 3
    assert cache.peek(NS_A, [1] * 6) == 2 and cache.peek(NS_B, [2, 2, 2, 2]) == 0
    assert NS_B not in cache.snapshot()  # an emptied namespace keeps nothing
    assert cache.peek(NS_A, [3, 3, 3, 3]) == 4
    assert cache.evict(100) == 3 and pool.all_free() and cache.cached_pages == 0
    cache.check_invariants()


def test_preempted_sequence_resumes_from_its_cached_prefix() -> None:
    pool, cache = make(block_size=4)
    prompt = list(range(11))
    m = cache.match_prefix(NS_A, prompt[:-1])
    pages = pool.allocate(3)
    computed = prompt[:9]  # preempted after nine tokens of prefill
    assert cache.insert(NS_A, computed, pages) == 8
    pool.release(pages[2:])
    cache.unlock(m.handle)
    again = cache.match_prefix(NS_A, prompt[:-1])
    assert again.num_tokens == 8 and again.pages == pages[:2]
    pool.release(again.pages)
    cache.unlock(again.handle)
    cache.check_invariants()


def test_bad_input_is_rejected_clearly() -> None:
    pool, cache = make()
    with pytest.raises(ValueError, match="namespace"):
        cache.match_prefix(b"", [1, 2])
    with pytest.raises(TypeError, match="bytes"):
        cache.match_prefix("tenant", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tokens"):
        cache.match_prefix(NS_A, [])
    with pytest.raises(ValueError, match="tokens"):
        cache.insert(NS_A, [], [])
    with pytest.raises(ValueError, match="full pages"):
        cache.insert(NS_A, [1, 2, 3, 4], pool.allocate(1))
    with pytest.raises(ValueError, match="n_pages"):
        cache.evict(-1)
    with pytest.raises(ValueError, match="block_size"):
        RadixCache(pool, 0)
    assert cache.cached_pages == 0


def test_double_unlock_is_an_error_not_a_negative_count() -> None:
    pool, cache = make()
    run_and_insert(pool, cache, NS_A, [1, 2])
    m = cache.match_prefix(NS_A, [1, 2])
    cache.unlock(m.handle)
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(m.handle)
    pool.release(m.pages)
    cache.check_invariants()


def test_inserting_pages_the_caller_does_not_own_asserts_and_leaves_tree_intact() -> None:
    pool, cache = make()
    run_and_insert(pool, cache, NS_A, [1, 2, 3, 4])
    before = cache.snapshot()
    free_page = pool.allocate(1)[0]
    pool.release([free_page])
    with pytest.raises(AssertionError, match="free"):
        cache.insert(NS_A, [5, 6], [free_page])
    cached = before[NS_A][(1, 2)]
    pool.retain([cached])  # the caller does hold a ref, but the page is cached at (1, 2)
    fresh = pool.allocate(1)
    with pytest.raises(AssertionError, match="another position"):
        cache.insert(NS_A, [9, 9, 9, 9], [fresh[0], cached])
    pool.release([cached, *fresh])
    with pytest.raises(AssertionError, match="holds no ref"):  # its own position, no caller ref
        cache.insert(NS_A, [1, 2], [cached])
    assert cache.snapshot() == before
    cache.check_invariants()


# ----- property-based test against a reference model ----------------------------------------


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
                leaves += [(self.access[(ns, k)], ns, k) for k in ents if k not in parents and (ns, k) not in locked]
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


def test_everything_released_leaves_no_pages_behind() -> None:
    pool, cache = make(num_pages=32, block_size=3)
    for i in range(6):
        run_and_insert(pool, cache, NS_A if i % 2 else NS_B, [i % 3] * 7 + [i])
    assert pool.num_free + cache.cached_pages == 32
    assert cache.evict(cache.cached_pages) > 0
    assert pool.all_free() and cache.snapshot() == {}
