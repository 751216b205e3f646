"""Radix prefix cache: unit tests (the state machine against a reference model is in
`tests/worker/kvcache/test_radix_cache_model.py`)."""

from __future__ import annotations

import pytest

from worker.kvcache.page_pool import PagePool
from worker.kvcache.radix_cache import PrefixMatch, RadixCache

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


def test_everything_released_leaves_no_pages_behind() -> None:
    pool, cache = make(num_pages=32, block_size=3)
    for i in range(6):
        run_and_insert(pool, cache, NS_A if i % 2 else NS_B, [i % 3] * 7 + [i])
    assert pool.num_free + cache.cached_pages == 32
    assert cache.evict(cache.cached_pages) > 0
    assert pool.all_free() and cache.snapshot() == {}
