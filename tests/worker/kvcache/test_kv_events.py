"""What the radix cache reports: the gateway's block ids for what it stores, evicts and holds; numbered
batches with a bound; eviction in LRU order through the heap."""

from __future__ import annotations

import random

from worker.kvcache.events import KvEvents, kv_report
from worker.kvcache.page_pool import PagePool
from worker.kvcache.radix_cache import RadixCache
from worker.protocol import HASH_ALGO, block_ids

BS = 4
NS = b"n" * 16


def cache_with(pages: int = 64) -> tuple[RadixCache, PagePool]:
    pool = PagePool(pages)
    return RadixCache(pool, BS), pool


def insert(cache: RadixCache, pool: PagePool, tokens: list[int], ns: bytes = NS) -> None:
    m = cache.match_prefix(ns, tokens)
    pages = m.pages + pool.allocate(len(tokens) // BS - len(m.pages))
    cache.insert(ns, tokens, pages)
    cache.unlock(m.handle)


def test_stored_ids_are_the_gateway_block_ids_and_splits_keep_them() -> None:
    cache, pool = cache_with()
    a = list(range(100, 124))  # 6 blocks
    b = a[:8] + list(range(500, 508))  # shares 2 blocks with a: splits a's edge
    insert(cache, pool, a)
    batch = cache.events.next_batch(cache.held_block_ids)
    assert batch is not None and not batch.snapshot and batch.seq == 1
    assert sorted(batch.stored) == sorted(block_ids(NS, a, BS)) and batch.evicted == []
    insert(cache, pool, b)
    batch = cache.events.next_batch(cache.held_block_ids)
    assert sorted(batch.stored) == sorted(block_ids(NS, b, BS)[2:])  # only the new blocks
    assert sorted(cache.held_block_ids()) == sorted(set(block_ids(NS, a, BS)) | set(block_ids(NS, b, BS)))
    cache.check_invariants()
    assert cache.events.next_batch(cache.held_block_ids) is None  # nothing new


def test_evictions_are_reported_and_a_store_then_evict_nets_out() -> None:
    cache, pool = cache_with()
    a, b = list(range(100, 116)), list(range(200, 216))
    insert(cache, pool, a)
    cache.events.next_batch(cache.held_block_ids)
    insert(cache, pool, b)
    assert cache.evict(4) == 4  # a is older: evicted whole (4 pages)
    batch = cache.events.next_batch(cache.held_block_ids)
    assert sorted(batch.stored) == sorted(block_ids(NS, b, BS))
    assert sorted(batch.evicted) == sorted(block_ids(NS, a, BS))
    cache.evict(2)  # trims b's last two pages
    batch = cache.events.next_batch(cache.held_block_ids)
    assert sorted(batch.evicted) == sorted(block_ids(NS, b, BS)[2:]) and batch.stored == []
    assert sorted(cache.held_block_ids()) == sorted(block_ids(NS, b, BS)[:2])


def test_the_log_is_bounded_and_overflows_into_a_snapshot() -> None:
    events = KvEvents(max_pending=10)
    events.stored(range(8))
    events.evicted(range(100, 105))  # 13 pending > 10: dropped
    assert events.pending == 0
    batch = events.next_batch(lambda: [1, 2, 3])
    assert batch.snapshot and batch.stored == [1, 2, 3] and batch.seq == 1


def test_kv_report_carries_the_contract_and_numbers() -> None:
    cache, pool = cache_with()
    insert(cache, pool, list(range(8)))
    first = kv_report(cache, BS, "tok-9")
    assert first.contract.block_size == BS and first.contract.hash_algo == HASH_ALGO
    assert first.contract.tokenizer == "tok-9" and first.seq == 1 and len(first.stored) == 2
    idle = kv_report(cache, BS, "tok-9")  # nothing new: an empty report under the last number
    assert (idle.seq, idle.stored, idle.evicted, idle.snapshot) == (1, [], [], False)
    snap = kv_report(cache, BS, "tok-9", snapshot=True)
    assert snap.snapshot and snap.seq == 1 and sorted(snap.stored) == sorted(first.stored)
    assert kv_report(None, BS, "tok-9") is None


def test_eviction_follows_lru_one_page_at_a_time() -> None:
    """The heap-based evict drops leaves in the order a full rebuild would (last access, then age)."""
    rng = random.Random(5)
    cache, pool = cache_with(pages=400)
    prompts = [[rng.randrange(1000) for _ in range(BS * rng.randint(1, 4))] for _ in range(60)]
    for p in prompts:
        insert(cache, pool, p)
    for p in rng.sample(prompts, 20):  # touch some again
        insert(cache, pool, p)
    while cache.cached_pages:
        leaves = cache._evictable_leaves
        want = min(leaves, key=lambda n: (n.last_access, n.uid))
        pages_before = set(want.pages)
        assert cache.evict(1) == 1
        assert len(pages_before - set(p for n in leaves for p in n.pages)) >= 1 or want not in leaves
        cache.check_invariants()
    assert cache.held_block_ids() == [] and pool.num_free == pool.num_pages


def test_stats_with_a_block_report_round_trip_and_sync_decodes() -> None:
    from worker import protocol as proto

    kv = proto.KvReport(proto.KvContract(16, HASH_ALGO, "t"), 2**62, 5, False, [1, 2**64 - 1], [7])
    stats = proto.WorkerStats("w", 0, 1, 10, 20, 0.5, False, "m", proto.PROTOCOL_VERSION, kv=kv)
    back = proto.decode_worker_frame(proto.encode_stats(stats))
    assert back.kv == kv and back.kv_error == ""
    plain = proto.WorkerStats("w", 0, 1, 10, 20, 0.5, False, "m", proto.PROTOCOL_VERSION)
    assert proto.decode_worker_frame(proto.encode_stats(plain)).kv is None  # an older worker: no report
    assert isinstance(proto.decode_gateway_frame(proto.encode_sync(), 100), proto.Sync)


def test_promises_report_at_admission_and_withdraw_what_was_never_stored() -> None:
    from worker.kvcache.events import KvPromises

    cache, pool = cache_with()
    promises = KvPromises(cache, BS)
    a, b = list(range(100, 113)), list(range(100, 108)) + [1, 2, 3, 4, 5]  # 3 promised blocks each, 2 shared
    promises.promise("ra", NS, a)
    promises.promise("rb", NS, b)
    batch = cache.events.next_batch(cache.held_block_ids)
    assert sorted(batch.stored) == sorted(set(block_ids(NS, a, BS)[:3]) | set(block_ids(NS, b, BS)[:3]))
    insert(cache, pool, a[:12])  # ra's prefill ran: its blocks are in the tree
    cache.events.next_batch(cache.held_block_ids)
    alive = {"rb"}
    promises.settle(lambda rid: rid in alive)
    assert cache.events.next_batch(cache.held_block_ids) is None  # ra kept its promise: nothing to withdraw
    alive.clear()  # rb aborted before its prefill: its own block is withdrawn, the shared ones are held
    promises.settle(lambda rid: rid in alive)
    batch = cache.events.next_batch(cache.held_block_ids)
    assert batch.evicted == [block_ids(NS, b, BS)[2]] and len(promises) == 0
