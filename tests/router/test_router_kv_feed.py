"""The router's vLLM-format KV event subscriber over real ZeroMQ sockets, fed by a hand-built publisher that
sends what a vLLM server sends (PUB [topic, seq, msgpack batch], ROUTER replay answered up to seq -1)."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import zmq

from router.links.kv_feed import REPLAY_TIMEOUT_S, KvFeed
from router.links.kv_ingest import FeedSource
from router.placement.kv_index import KvIndex
from router.placement.routing_metrics import KV_INDEX_BLOCKS
from worker.protocol import block_ids

BS = 4
NS = bytes(range(16))  # a tenant's namespace root; the vLLM requests carried cache_salt = NS.hex()
DEADLINE_S = 5.0


class FakeVllm:
    """A vLLM server's event sockets, driven by the test."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.bind("tcp://127.0.0.1:*")
        self.sent: dict[int, bytes] = {}
        for s in (self.pub, self.replay):
            s.setsockopt(zmq.LINGER, 0)

    def endpoints(self) -> tuple[str, str]:
        last = zmq.LAST_ENDPOINT
        return self.pub.getsockopt_string(last), self.replay.getsockopt_string(last)

    def send(self, seq: int, events: list, live: bool = True) -> None:
        payload = msgspec.msgpack.encode([time.time(), events, 0])
        self.sent[seq] = payload
        if live:
            self.pub.send_multipart([b"kv@v1@m", seq.to_bytes(8, "big"), payload])

    def answer_replay(self) -> int:
        assert self.replay.poll(int(DEADLINE_S * 1000)), "no replay request"
        ident, _, raw = self.replay.recv_multipart()
        start = int.from_bytes(raw, "big")
        for seq in sorted(s for s in self.sent if s >= start):
            self.replay.send_multipart([ident, b"", seq.to_bytes(8, "big"), self.sent[seq]])
        self.replay.send_multipart([ident, b"", (-1).to_bytes(8, "big", signed=True), b""])
        return start

    def close(self) -> None:
        self.pub.close()
        self.replay.close()


def stored(hashes: list[int], tokens: list[int], parent: int | None = None, salt: str | None = None,
           medium: str | None = "GPU") -> list:
    extra = [[salt] if salt else None] + [None] * (len(hashes) - 1)
    return ["BlockStored", hashes, parent, tokens, BS, None, medium, None, extra]


def setup(ctx: zmq.Context, hashes: str = "vllm", **kw: object) -> tuple[FakeVllm, KvFeed, KvIndex]:
    vllm = FakeVllm(ctx)
    pub, rep = vllm.endpoints()
    index = KvIndex()
    feed = KvFeed(ctx, FeedSource("v1", pub, rep, hashes, "kv@", 1000), index, BS, **kw)  # type: ignore[arg-type]
    time.sleep(0.2)  # the subscription reaches the PUB socket
    return vllm, feed, index


def until(feed: KvFeed, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S} s: {dict(feed.ingest.counts)}"
        feed.step()
        time.sleep(0.005)


def test_a_vllm_servers_salted_blocks_are_indexed_under_the_tenants_ids() -> None:
    ctx = zmq.Context()
    vllm, feed, index = setup(ctx)
    try:
        prompt = list(range(10, 22))  # 3 blocks: 2 in one event, the third chained on the second
        vllm.send(0, [stored([111, 222], prompt[:8], salt=NS.hex()), ["FutureEvent", 1, 2],
                      stored([999], [1, 2, 3, 4])])  # unsalted: no tenant's prompt can match it
        until(feed, lambda: index.blocks("v1") == 2)
        vllm.send(1, [stored([333], prompt[8:], parent=222)])
        until(feed, lambda: index.blocks("v1") == 3)
        assert KV_INDEX_BLOCKS.labels("v1")._value.get() == 3  # the gauge the stats stream's reports set too
        ids = block_ids(NS, prompt, BS)
        assert index.match(ids, ["v1"]) == {"v1": 3}
        assert index.match(block_ids(b"x" * 16, prompt, BS), ["v1"]) == {}  # another tenant's: no match
        counts = feed.ingest.counts
        assert counts["unknown:FutureEvent"] == 1 and counts["unsalted"] == 1
        vllm.send(2, [["BlockRemoved", [333], "GPU"]])
        until(feed, lambda: index.blocks("v1") == 2)
        assert index.match(ids, ["v1"]) == {"v1": 2}
    finally:
        feed.close()
        vllm.close()
        ctx.term()


def test_a_seq_gap_asks_for_a_replay_and_applies_the_missed_batch() -> None:
    ctx = zmq.Context()
    vllm, feed, index = setup(ctx, hashes="switchyard")
    try:
        vllm.send(0, [stored([1], [0] * BS)])
        until(feed, lambda: index.blocks("v1") == 1)
        vllm.send(1, [stored([2], [0] * BS)], live=False)  # lost on the way
        vllm.send(2, [stored([3], [0] * BS)])
        until(feed, lambda: feed.replaying)
        assert vllm.answer_replay() == 1
        until(feed, lambda: not feed.replaying and index.blocks("v1") == 3)
        assert index.match([1, 2, 3], ["v1"]) == {"v1": 3} and feed.ingest.next_seq == 3
    finally:
        feed.close()
        vllm.close()
        ctx.term()


def test_all_blocks_cleared_clears_and_a_restart_starts_over() -> None:
    ctx = zmq.Context()
    vllm, feed, index = setup(ctx, hashes="switchyard")
    try:
        vllm.send(0, [stored([1, 2, 3], [0] * 3 * BS), stored([7], [0] * BS, medium="CPU")])
        until(feed, lambda: index.blocks("v1") == 3)
        assert index.match_tiered([1, 2, 3, 7], ["v1"]) == {"v1": (3, 1)}
        vllm.send(1, [["AllBlocksCleared"], stored([4], [0] * BS)])
        until(feed, lambda: index.blocks("v1") == 1)
        assert index.match([4], ["v1"]) == {"v1": 1} and index.match_tiered([1, 7], ["v1"]) == {}
        vllm.send(0, [stored([5], [0] * BS)])  # the numbers went back: a new publisher process
        until(feed, lambda: index.match([5], ["v1"]) == {"v1": 1})
        assert index.blocks("v1") == 1 and feed.ingest.counts["restart"] == 1
    finally:
        feed.close()
        vllm.close()
        ctx.term()


def test_an_unanswered_replay_ends_at_its_deadline_and_the_view_starts_over() -> None:
    ctx = zmq.Context()
    now = [0.0]
    vllm, feed, index = setup(ctx, hashes="switchyard", clock=lambda: now[0])
    try:
        vllm.send(0, [stored([1], [0] * BS)])
        until(feed, lambda: index.blocks("v1") == 1)
        vllm.send(2, [stored([3], [0] * BS)])
        until(feed, lambda: feed.replaying)
        now[0] += REPLAY_TIMEOUT_S + 0.1  # the fake never answers
        until(feed, lambda: not feed.replaying)
        assert feed.ingest.counts["replay_failed"] == 1
        vllm.send(3, [stored([4], [0] * BS)])
        until(feed, lambda: index.blocks("v1") == 1 and index.match([4], ["v1"]) == {"v1": 1})
    finally:
        feed.close()
        vllm.close()
        ctx.term()


def test_bounds_the_rekeying_memory_and_the_workers_blocks() -> None:
    ctx = zmq.Context()
    vllm, feed, index = setup(ctx)
    feed.ingest.max_keys = 2
    try:
        for seq in range(3):  # three one-block prompts: the first one's vLLM hash is forgotten
            vllm.send(seq, [stored([100 + seq], [seq] * BS, salt=NS.hex())])
        until(feed, lambda: index.blocks("v1") == 3)
        assert len(feed.ingest._keys) == 2
        vllm.send(3, [stored([200], [9] * BS, parent=100)])  # chains on the forgotten one
        until(feed, lambda: feed.ingest.counts["orphan"] == 1)
        big = list(range(1000, 2400))  # past the source's 1000 blocks (with KvIndex's slack)
        vllm.send(4, [stored(big, [0] * BS * len(big), salt=NS.hex())])
        until(feed, lambda: feed.ingest.counts["index:overflow"] == 1)
        assert index.blocks("v1") == 0
    finally:
        feed.close()
        vllm.close()
        ctx.term()
