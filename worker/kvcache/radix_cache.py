"""Radix-tree prefix cache: reuse the KV pages of shared, page-aligned token prefixes per namespace.

The tree owns one pool reference per cached page; locked pages (on a live match) are never evicted.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from worker.kvcache.events import KvEvents
from worker.kvcache.page_pool import PagePool
from worker.protocol.block_hash import block_id, chain


@dataclass(slots=True, eq=False)
class RadixNode:
    """One edge of the tree: `key` tokens (a multiple of block_size) stored in `pages`."""

    key: tuple[int, ...]
    pages: list[int]
    parent: RadixNode | None
    uid: int
    last_access: int = 0
    lock_count: int = 0
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    ns: bytes = b""  # set on namespace roots only
    # the chained block digest of each page (worker.protocol.block_hash)
    hashes: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class PrefixMatch:
    """Result of `match_prefix`: one reference to each page is now the caller's."""

    pages: list[int]
    num_tokens: int
    handle: RadixNode | None  # pass to `unlock` exactly once; None when nothing matched


class RadixCache:
    """Page ownership: the tree holds one pool reference per cached page; a sequence using one holds its own.

    The lifecycle the scheduler follows::

        m = cache.match_prefix(ns, prompt[:-1])   # locks the path, hands you one ref per m.pages
        pages = m.pages + pool.allocate(...)      # block table; prefill starts at m.num_tokens
        n = cache.insert(ns, computed, pages)     # on finish or preemption; computed = tokens whose KV is in
        pages pool.release(pages[len(computed) // cache.block_size:])   # trailing partial page stays yours
        cache.unlock(m.handle)                    # exactly once per match, after insert
        # on abort instead of insert: pool.release(pages); cache.unlock(m.handle)

    Every unlocked cached page is evictable, so `pool.num_free + evictable_pages` is what admission can count
    on. Every page stored or dropped is logged by block id in `events` (what gateways route on). Eviction pops
    a heap of evictable leaves keyed by last access; an entry whose leaf was touched or left the set since is
    stale and skipped, and the heap is rebuilt when stale entries outnumber live ones, so each evicted page
    costs O(log n). Not thread-safe: the engine loop is its only user.
    """

    def __init__(self, pool: PagePool, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self._roots: dict[bytes, RadixNode] = {}
        self._evictable_leaves: set[RadixNode] = set()
        self._heap: list[tuple[int, int, RadixNode]] = []  # (last_access, uid, leaf); may hold stale entries
        self.events = KvEvents(max_pending=4 * pool.num_pages + 1024)
        self._tree_pages: set[int] = set()
        self._locked_pages = 0
        self._clock = 0
        self._next_uid = 0
        self.hit_tokens = 0
        self.lookup_tokens = 0
        self.evicted_pages = 0
        # called with (block digests, pages) just before evicted pages are released (the KV tiers keep them)
        self.on_evict: Callable[[list[bytes], list[int]], None] | None = None

    @property
    def cached_pages(self) -> int:
        return len(self._tree_pages)

    @property
    def locked_pages(self) -> int:
        return self._locked_pages

    @property
    def evictable_pages(self) -> int:
        return len(self._tree_pages) - self._locked_pages

    @property
    def hit_rate(self) -> float:
        """Matched tokens over looked-up tokens since start (0.0 before any lookup)."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    def match_prefix(self, ns: bytes, tokens: Sequence[int]) -> PrefixMatch:
        """Longest cached page-aligned prefix of `tokens` in `ns`: locked, one ref per page retained."""
        toks = self._check(ns, tokens)
        self.lookup_tokens += len(toks)
        node, pos, pages = self._lock_longest(ns, toks)
        self.pool.retain(pages)
        self.hit_tokens += pos
        return PrefixMatch(pages, pos, node)

    def lock_prefix(self, ns: bytes, tokens: Sequence[int]) -> tuple[RadixNode | None, int]:
        """`match_prefix` taking no page references and counting no look-up: (handle to `unlock`, tokens)."""
        node, pos, _ = self._lock_longest(ns, self._check(ns, tokens))
        return node, pos

    def _lock_longest(self, ns: bytes, toks: tuple[int, ...]) -> tuple[RadixNode | None, int, list[int]]:
        root = self._roots.get(ns)
        if root is None:
            return None, 0, []
        self._clock += 1
        node, pos, pages = root, 0, []
        while True:
            child, common = self._step(node, toks, pos)
            if child is None:
                break
            if common < len(child.pages):
                child = self._split(child, common)
            child.last_access = self._clock
            pages.extend(child.pages)
            pos += len(child.key)
            node = child
        if node is root:
            return None, 0, []
        self._lock(node)
        return node, pos, pages

    def peek(self, ns: bytes, tokens: Sequence[int]) -> int:
        """Number of cached prefix tokens `match_prefix` would return; changes nothing."""
        toks = self._check(ns, tokens)
        return len(self._cached_pages_of(ns, toks)) * self.block_size

    def unlock(self, handle: RadixNode | None) -> None:
        """Release the lock taken by the `match_prefix` that returned `handle`."""
        if handle is None:
            return
        if handle.lock_count <= 0:
            raise RuntimeError("unlock of a prefix that is not locked (unlocked twice?)")
        node: RadixNode | None = handle
        while node is not None and node.parent is not None:
            node.lock_count -= 1
            if node.lock_count == 0:
                self._locked_pages -= len(node.pages)
                if not node.children:
                    self._mark_evictable(node)
            node = node.parent

    def insert(self, ns: bytes, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Cache the full pages of `tokens` (whose KV is in `pages`); returns newly cached tokens.

        Takes `len(tokens) // block_size` pages from the front of `pages` together with
        the caller's reference to each: pages the tree keeps become the tree's, pages
        for a prefix the tree already holds are released. Later pages stay the caller's.
        """
        toks = self._check(ns, tokens)
        n_full = len(toks) // self.block_size
        if len(pages) < n_full:
            raise ValueError(f"{len(toks)} tokens need {n_full} full pages, got {len(pages)}")
        if n_full == 0:
            return 0
        toks, pages = toks[: n_full * self.block_size], list(pages[:n_full])
        if __debug__:
            self._assert_insertable(ns, toks, pages)
        self._clock += 1
        root = self._roots.get(ns)
        if root is None:
            root = self._roots[ns] = self._new_node((), [], None)
            root.ns = ns
        node, pos = root, 0
        while pos < len(toks):
            child, common = self._step(node, toks, pos)
            if child is None:
                self._add_leaf(ns, node, toks[pos:], pages[pos // self.block_size:])
                return len(toks) - pos
            if common < len(child.pages):
                child = self._split(child, common)
            first = pos // self.block_size
            self.pool.release(pages[first: first + common])  # duplicates of what the tree holds
            self._touch(child)
            pos += len(child.key)
            node = child
        return 0

    def evict(self, n_pages: int) -> int:
        """Drop up to `n_pages` unlocked pages, least recently used leaves first; returns pages dropped.

        Each dropped page loses the tree's reference; under the documented protocol
        (sequences hold locks on the cached pages they use) it returns to the free list.
        """
        if n_pages < 0:
            raise ValueError(f"n_pages must be >= 0, got {n_pages}")
        dropped = 0
        while dropped < n_pages:
            leaf = self._pop_lru_leaf()
            if leaf is None:
                break
            take = min(len(leaf.pages), n_pages - dropped)
            if take < len(leaf.pages):
                self._trim_leaf(leaf, take)
                heapq.heappush(self._heap, (leaf.last_access, leaf.uid, leaf))  # still an evictable leaf
            else:
                self._remove_leaf(leaf)
            dropped += take
        self.evicted_pages += dropped
        return dropped

    def held_block_ids(self) -> list[int]:
        """The block id of every cached page (a snapshot for gateways); walks the whole tree."""
        ids: list[int] = []
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                ids.extend(block_id(h) for h in node.hashes)
                stack.extend(node.children.values())
        return ids

    def snapshot(self) -> dict[bytes, dict[tuple[int, ...], int]]:
        """Every cached page as {namespace: {page-aligned token prefix: page id}}."""
        out: dict[bytes, dict[tuple[int, ...], int]] = {}
        bs = self.block_size
        for ns, root in self._roots.items():
            entries = out[ns] = {}
            stack: list[tuple[RadixNode, tuple[int, ...]]] = [(root, ())]
            while stack:
                node, prefix = stack.pop()
                for i, page in enumerate(node.pages):
                    entries[prefix + node.key[: (i + 1) * bs]] = page
                prefix += node.key
                stack.extend((child, prefix) for child in node.children.values())
        return out

    def check_invariants(self) -> None:
        """Raise AssertionError if the tree's structure or counters are inconsistent."""
        bs, seen, locked, leaves = self.block_size, set(), 0, set()
        for ns, root in self._roots.items():
            assert root.ns == ns and not root.pages and root.children, f"bad root for {ns!r}"
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                assert node.pages and len(node.key) == len(node.pages) * bs, "edge is not whole pages"
                assert len(node.hashes) == len(node.pages), "a page without its block hash"
                assert node.parent is not None and node.parent.children[node.key[:bs]] is node
                assert node.lock_count >= 0, "negative lock count"
                assert node.lock_count <= node.parent.lock_count or node.parent.parent is None, \
                    "a locked node below an unlocked one"
                assert node.last_access <= node.parent.last_access or node.parent.parent is None
                assert seen.isdisjoint(node.pages), "a page cached twice"
                seen.update(node.pages)
                locked += len(node.pages) if node.lock_count else 0
                if not node.children and not node.lock_count:
                    leaves.add(node)
                stack.extend(node.children.values())
        assert seen == self._tree_pages, "page set out of sync"
        assert locked == self._locked_pages, "locked page counter out of sync"
        assert leaves == self._evictable_leaves, "evictable leaf set out of sync"
        assert all(self.pool.refcount(p) > 0 for p in seen), "a cached page is free in the pool"

    def _check(self, ns: bytes, tokens: Sequence[int]) -> tuple[int, ...]:
        if not isinstance(ns, bytes):
            raise TypeError(f"cache namespace must be bytes, got {type(ns).__name__}")
        if not ns:
            raise ValueError("cache namespace must be non-empty bytes")
        if len(tokens) == 0:
            raise ValueError("tokens must be non-empty")
        return tokens if isinstance(tokens, tuple) else tuple(tokens)

    def _step(self, node: RadixNode, toks: tuple[int, ...], pos: int) -> tuple[RadixNode | None, int]:
        """The child of `node` matching `toks[pos:]` and the number of whole pages they share."""
        bs = self.block_size
        if len(toks) - pos < bs:
            return None, 0
        child = node.children.get(toks[pos: pos + bs])
        if child is None:
            return None, 0
        key = child.key
        if toks[pos: pos + len(key)] == key:
            return child, len(child.pages)
        limit = min(len(key), len(toks) - pos) // bs
        common = 1  # the first page matched through the dict key
        while common < limit and key[common * bs: (common + 1) * bs] == toks[
            pos + common * bs: pos + (common + 1) * bs
        ]:
            common += 1
        return child, common

    def _cached_pages_of(self, ns: bytes, toks: tuple[int, ...]) -> list[int]:
        """Pages of the longest cached prefix, read-only (no split, no lock, no access time)."""
        node, pos, pages = self._roots.get(ns), 0, []
        while node is not None:
            child, common = self._step(node, toks, pos)
            if child is None:
                break
            pages.extend(child.pages[:common])
            if common < len(child.pages):
                break
            pos += len(child.key)
            node = child
        return pages

    def _new_node(self, key: tuple[int, ...], pages: list[int], parent: RadixNode | None) -> RadixNode:
        self._next_uid += 1
        return RadixNode(key, pages, parent, self._next_uid, self._clock)

    def _split(self, node: RadixNode, n_pages: int) -> RadixNode:
        """Cut `node` after its first `n_pages` pages; returns the new upper part."""
        cut = n_pages * self.block_size
        parent = node.parent
        assert parent is not None and 0 < n_pages < len(node.pages)
        upper = self._new_node(node.key[:cut], node.pages[:n_pages], parent)
        upper.last_access, upper.lock_count = node.last_access, node.lock_count
        upper.hashes, node.hashes = node.hashes[:n_pages], node.hashes[n_pages:]
        parent.children[upper.key[: self.block_size]] = upper
        node.key, node.pages, node.parent = node.key[cut:], node.pages[n_pages:], upper
        upper.children[node.key[: self.block_size]] = node
        return upper

    def _add_leaf(self, ns: bytes, parent: RadixNode, key: tuple[int, ...], pages: list[int]) -> None:
        leaf = self._new_node(key, pages, parent)
        leaf.hashes = chain(ns, parent.hashes[-1] if parent.hashes else ns, key, self.block_size)
        parent.children[key[: self.block_size]] = leaf
        self._evictable_leaves.discard(parent)
        self._mark_evictable(leaf)
        self._tree_pages.update(pages)
        self.events.stored(block_id(h) for h in leaf.hashes)

    def _mark_evictable(self, leaf: RadixNode) -> None:
        self._evictable_leaves.add(leaf)
        heapq.heappush(self._heap, (leaf.last_access, leaf.uid, leaf))

    def _touch(self, node: RadixNode) -> None:
        """Mark `node` used now; an evictable leaf gets a fresh heap entry (the old one turns stale)."""
        node.last_access = self._clock
        if node in self._evictable_leaves:
            heapq.heappush(self._heap, (node.last_access, node.uid, node))

    def _pop_lru_leaf(self) -> RadixNode | None:
        """The least recently used evictable leaf (left in the set), skipping stale heap entries."""
        heap, leaves = self._heap, self._evictable_leaves
        if len(heap) > 2 * len(leaves) + 64:  # mostly stale: rebuild from the live set
            heap[:] = [(n.last_access, n.uid, n) for n in leaves]
            heapq.heapify(heap)
        while heap:
            access, _, leaf = heapq.heappop(heap)
            if leaf in leaves and leaf.last_access == access:
                return leaf
        return None

    def _lock(self, node: RadixNode) -> None:
        cur: RadixNode | None = node
        while cur is not None and cur.parent is not None:
            if cur.lock_count == 0:
                self._locked_pages += len(cur.pages)
                self._evictable_leaves.discard(cur)
            cur.lock_count += 1
            cur = cur.parent

    def _trim_leaf(self, leaf: RadixNode, n_pages: int) -> None:
        """Drop the last `n_pages` pages of an unlocked leaf."""
        dropped, hashes = leaf.pages[-n_pages:], leaf.hashes[-n_pages:]
        del leaf.pages[-n_pages:], leaf.hashes[-n_pages:]
        leaf.key = leaf.key[: len(leaf.pages) * self.block_size]
        self.events.evicted(block_id(h) for h in hashes)
        self._drop_pages(dropped, hashes)

    def _remove_leaf(self, leaf: RadixNode) -> RadixNode:
        """Unlink an unlocked leaf and drop its pages; returns its parent."""
        parent = leaf.parent
        assert parent is not None and leaf.lock_count == 0 and not leaf.children
        del parent.children[leaf.key[: self.block_size]]
        self._evictable_leaves.discard(leaf)
        self.events.evicted(block_id(h) for h in leaf.hashes)
        self._drop_pages(leaf.pages, leaf.hashes)
        if not parent.children:
            if parent.parent is None:
                del self._roots[parent.ns]  # an empty namespace keeps no memory
            elif parent.lock_count == 0:
                self._mark_evictable(parent)
        return parent

    def _drop_pages(self, pages: list[int], hashes: list[bytes]) -> None:
        if self.on_evict is not None:
            self.on_evict(hashes, pages)  # before the pages are freed: the KV tiers copy them out
        self._tree_pages.difference_update(pages)
        self.pool.release(pages)

    def _assert_insertable(self, ns: bytes, toks: tuple[int, ...], pages: list[int]) -> None:
        """Debug check, before any change: the caller owns every page it hands over."""
        assert len(set(pages)) == len(pages), "insert: the same page appears twice"
        held = self._cached_pages_of(ns, toks)
        for i, p in enumerate(pages):
            assert self.pool.refcount(p) > 0, f"insert: page {p} is free, the caller does not own it"
            if i < len(held) and p == held[i]:
                assert self.pool.refcount(p) >= 2, f"insert: page {p} is cached but the caller holds no ref"
            else:
                assert p not in self._tree_pages, f"insert: page {p} is cached at another position"
