"""The worker's vLLM-format KV events over real ZeroMQ sockets: what a vLLM subscriber reads (topic, 8-byte
big-endian seq, msgpack KVEventBatch) carries the radix cache's block ids; replay and its bounds."""

from __future__ import annotations

import time

import msgspec
import zmq

from worker.kvcache.events import KvBatch, kv_report
from worker.kvcache.page_pool import PagePool
from worker.kvcache.radix_cache import RadixCache
from worker.protocol import block_ids
from worker.protocol.vllm_events import REPLAY_END, AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from worker.server.process.kv_publisher import KvEventPublisher, PublisherConfig, start_publisher

BS = 4
NS = b"t" * 16
DEADLINE_S = 5.0


def cache_with(pages: int = 64) -> tuple[RadixCache, PagePool]:
    pool = PagePool(pages)
    return RadixCache(pool, BS), pool


def insert(cache: RadixCache, pool: PagePool, tokens: list[int]) -> None:
    m = cache.match_prefix(NS, tokens)
    cache.insert(NS, tokens, m.pages + pool.allocate(len(tokens) // BS - len(m.pages)))
    cache.unlock(m.handle)


def local(**kw: int) -> PublisherConfig:
    # "*" in the endpoint: bound (vLLM's rule), on a free loopback port
    return PublisherConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "kv@w1@tiny", BS, **kw)


def publisher(ctx: zmq.Context, **kw: int) -> KvEventPublisher:
    return KvEventPublisher(ctx, local(**kw))


def subscriber(ctx: zmq.Context, pub: KvEventPublisher) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(pub.endpoints()[0])
    time.sleep(0.2)  # PUB drops what it sends before the subscription arrives
    return sub


def recv(sock: zmq.Socket) -> list[bytes]:
    assert sock.poll(int(DEADLINE_S * 1000)), "nothing within the deadline"
    return sock.recv_multipart()


def replay(ctx: zmq.Context, pub: KvEventPublisher, start: int) -> list[tuple[int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.endpoints()[1])
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        _, seq, payload = recv(dealer)
        if seq == REPLAY_END:
            dealer.close()
            return out
        out.append((int.from_bytes(seq, "big"), payload))


def test_batches_decode_as_vllm_events_with_the_cache_ids() -> None:
    ctx = zmq.Context()
    cache, pool = cache_with()
    pub = start_publisher(ctx, local(), cache.events, None)
    sub = subscriber(ctx, pub)
    try:
        a = list(range(100, 124))
        insert(cache, pool, a)
        kv_report(cache, BS, "tok")  # the stats frame's batch is published too
        topic, seq, payload = recv(sub)
        assert topic == b"kv@w1@tiny" and seq == (0).to_bytes(8, "big")
        raw = msgspec.msgpack.decode(payload)  # as vLLM's array_like structs: [ts, events, rank]
        assert isinstance(raw, list) and isinstance(raw[0], float) and raw[2] == 0
        assert raw[1][0][:5] == ["BlockStored", raw[1][0][1], None, [], BS] and raw[1][0][6] == "GPU"
        _, events, bad = decode_batch(payload)
        assert bad == [] and len(events) == 1 and isinstance(events[0], BlockStored)
        assert sorted(events[0].block_hashes) == sorted(block_ids(NS, a, BS))
        cache.evict(2)
        kv_report(cache, BS, "tok")
        _, seq, payload = recv(sub)
        assert int.from_bytes(seq, "big") == 1
        (removed,) = decode_batch(payload)[1]
        assert isinstance(removed, BlockRemoved) and removed.medium == "GPU"
        assert set(removed.block_hashes) <= set(block_ids(NS, a, BS)) and len(removed.block_hashes) == 2
    finally:
        sub.close()
        pub.close()
        ctx.term()


def test_replay_answers_from_the_start_seq_and_a_buffer_miss_brings_a_snapshot() -> None:
    ctx = zmq.Context()
    pub = publisher(ctx, buffer_steps=2)
    held = [7, 8, 9]
    snap = KvBatch(1, 9, True, held, [])
    try:
        for i in range(3):
            pub.offer(KvBatch(1, i + 1, False, [i], []), lambda: snap)
        deadline = time.monotonic() + DEADLINE_S
        while len(pub._buffer) < 2 or pub._buffer[-1][0] != 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert [s for s, _ in replay(ctx, pub, 2)] == [2]
        assert pub.replay_misses == 0
        assert [s for s, _ in replay(ctx, pub, 0)] == [1, 2]  # batch 0 has left the bounded buffer
        assert pub.replay_misses == 1
        pub.offer(None, lambda: snap)  # no change, but a subscriber missed some: everything is sent
        deadline = time.monotonic() + DEADLINE_S
        while pub._seq < 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        events = decode_batch(pub._buffer[-1][1])[1]
        assert isinstance(events[0], AllBlocksCleared) and events[1].block_hashes == held
    finally:
        pub.close()
        ctx.term()


def test_a_full_queue_drops_the_batch_and_the_next_offer_is_a_snapshot() -> None:
    ctx = zmq.Context()
    pub = publisher(ctx, max_queue=1)
    pub._running = False  # the thread stops taking batches: the queue fills
    pub._thread.join(DEADLINE_S)
    try:
        snapshots = []

        def snap() -> KvBatch:
            snapshots.append(1)
            return KvBatch(1, 3, True, [5], [])

        pub.offer(KvBatch(1, 1, False, [1], []), snap)
        pub.offer(KvBatch(1, 2, False, [2], []), snap)  # no room
        assert pub.dropped == 1 and snapshots == []
        pub._queue.get_nowait()
        pub.offer(KvBatch(1, 3, False, [3], []), snap)
        assert snapshots == [1]
        events = pub._queue.get_nowait().events
        assert isinstance(events[0], AllBlocksCleared) and events[1].block_hashes == [5]
    finally:
        pub.close()
        ctx.term()


def test_a_worker_server_with_the_flag_publishes_its_prefix_cache_blocks() -> None:
    import torch

    from worker import protocol as proto
    from worker.config import EngineConfig
    from worker.engine.core import Engine
    from worker.model.tiny_model import load_tiny_model
    from worker.protocol import SamplingParams
    from worker.server.serve import ServerConfig, WorkerServer

    torch.set_num_threads(1)
    engine = Engine(load_tiny_model(dtype="float32", device="cpu"), EngineConfig())
    cfg = ServerConfig(bind="tcp://127.0.0.1:0", worker_id="w9", kv_events_endpoint="tcp://127.0.0.1:*")
    server = WorkerServer(engine, cfg)
    server.bind()
    assert server._kv_pub is not None
    sub = subscriber(server.ctx, server._kv_pub)
    server._send = lambda ident, payload: None  # type: ignore[method-assign]
    try:
        bs = engine.config.block_size
        ns = b"n" * 16
        tokens = [5 + i % 50 for i in range(3 * bs + 1)]
        sampling = SamplingParams(max_tokens=2, ignore_eos=True)
        server._handle(b"gw", proto.encode_gen("r1", ns, tokens, sampling))
        for _ in range(50):
            if not len(server.table):
                break
            server._step()
        server._send_stats()
        topic, _, payload = recv(sub)
        assert topic == f"kv@w9@{engine.model_id}".encode()
        ids = {h for ev in decode_batch(payload)[1] if isinstance(ev, BlockStored) for h in ev.block_hashes}
        assert set(block_ids(ns, tokens, bs, 3)) <= ids
    finally:
        sub.close()
        server._kv_pub.close()
        server.engine.close()
        server.sock.close()
        if server._auth is not None:
            server._auth.close()
        server.ctx.term()
