"""Two in-process worker servers (tiny fp32 model, real ZeroMQ sockets on loopback) and a gateway-side DEALER,
for the disaggregated prefill tests; engines stay reachable so tests can check that every page went back."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import msgpack
import torch
import zmq

from worker import protocol as proto
from worker.config import EngineConfig
from worker.engine.core import DEFAULT_NAMESPACE, Engine
from worker.engine.debug import pages_idle
from worker.protocol import PrefillHint, SamplingParams
from worker.server.serve import ServerConfig, WorkerServer

BS = 16
KV_BYTES = 16 << 20


def engine_config() -> EngineConfig:
    """Small steps (prefills take several chunks), a small pool, no KV tier."""
    return EngineConfig(block_size=BS, max_num_batched_tokens=64, kv_cache_bytes=KV_BYTES, kv_host_bytes=0)


class ServerThread:
    def __init__(self, model, role: str = "both", **server_kw) -> None:
        cfg = ServerConfig(bind="tcp://127.0.0.1:*", role=role, worker_id=f"{role}-w", stats_interval=0.05,
                           **server_kw)
        self.server = WorkerServer(Engine(model, engine_config()), cfg)
        self.endpoint = self.server.bind()
        self.thread = threading.Thread(target=self.server.run, kwargs={"signals": False}, daemon=True)
        self.thread.start()

    @property
    def engine(self) -> Engine:
        return self.server.engine

    def idle(self, timeout: float = 10.0) -> bool:
        """Wait until nothing is in flight, then check every page is free or cached once, unlocked."""
        until = time.monotonic() + timeout
        while time.monotonic() < until:
            if not len(self.server.table) and not self.server.decode.leases and not self.engine.has_work():
                time.sleep(0.1)  # let the loop finish the step it is in
                return pages_idle(self.engine)
            time.sleep(0.02)
        return False

    def stop(self) -> None:
        self.server.drain.start()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


class Gateway:
    """A DEALER that speaks the gateway side of the protocol to one worker."""

    def __init__(self, ctx: zmq.Context, endpoint: str, cluster_key: str | None = None) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if cluster_key:  # as a gateway does: the cluster's key pair, the worker as CURVE server
            secret = cluster_key.encode()
            self.sock.curve_secretkey = secret
            self.sock.curve_publickey = self.sock.curve_serverkey = zmq.curve_public(secret)
        self.sock.connect(endpoint)
        self.sock.send(proto.encode_hello("test-gw"))

    def generate(self, rid: str, tokens: list[int], sampling: SamplingParams, hint: PrefillHint | None,
                 timeout: float = 30.0) -> tuple[list[int], str | None, list]:
        """(tokens, finish reason, out items) of one request; raises on an err frame."""
        self.sock.send(proto.encode_gen(rid, b"ns", tokens, sampling, prefill=hint))
        return self.collect(rid, timeout)

    def collect(self, rid: str, timeout: float = 30.0) -> tuple[list[int], str | None, list]:
        toks: list[int] = []
        items = []
        until = time.monotonic() + timeout
        while time.monotonic() < until:
            if not self.sock.poll(100):
                continue
            frame = proto.decode_worker_frame(self.sock.recv())
            if isinstance(frame, proto.ErrFrame) and frame.rid == rid:
                raise RuntimeError(f"{frame.code}: {frame.message}")
            if isinstance(frame, proto.OutFrame):
                for item in frame.items:
                    if item.rid == rid:
                        items.append(item)
                        toks.extend(item.tokens)
                        if item.finish_reason is not None:
                            return toks, item.finish_reason, items
        raise TimeoutError(f"request {rid} did not finish")

    def close(self) -> None:
        self.sock.close(linger=0)


def prompt(seed: int, n: int) -> list[int]:
    """`n` seeded random token ids (prompts that share no prefix by chance)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 200, (n,), generator=g).tolist()


def first_reply(sock: zmq.Socket, timeout: float = 10.0) -> proto.KvChunk | proto.KvError | None:
    """The first transfer message a prefill worker sends `sock` (its
    stats frames skipped); None on timeout."""
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if sock.poll(100):
            try:
                return proto.decode_prefill_reply(sock.recv_multipart())
            except proto.TransferFrameError:
                continue  # a stats frame
    return None


def reference(model, tokens: list[int], sampling: SamplingParams) -> list[int]:
    """Greedy output of one engine doing prefill and decode itself."""
    engine = Engine(model, engine_config())
    try:
        return engine.generate([tokens], sampling)[0]
    finally:
        engine.close()


def prefix_rows(model, tokens: list[int]) -> torch.Tensor:
    """The K/V page rows of `tokens`' full blocks as a real prefill
    computes them (what a prefill worker pushes)."""
    engine = Engine(model, engine_config())
    try:
        engine.generate([tokens], SamplingParams(max_tokens=1))
        n = len(tokens) // BS * BS
        match = engine.cache.match_prefix(DEFAULT_NAMESPACE, tokens[:n])
        rows = engine.exports.codec.read(match.pages)
        engine.cache.unlock(match.handle)
        engine.pool.release(match.pages)
        return rows
    finally:
        engine.close()


class FakePrefill:
    """A ROUTER posing as a prefill worker: it records `pf` frames and sends whatever a test scripts."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def next_prefill(self, timeout: float = 10.0) -> tuple[bytes, dict]:
        until = time.monotonic() + timeout
        while time.monotonic() < until:
            if self.sock.poll(100):
                ident, data = self.sock.recv_multipart()
                obj = msgpack.unpackb(data, raw=False)
                if obj.get("t") == "pf":
                    return ident, obj
        raise TimeoutError("no pf frame")

    def send(self, ident: bytes, *parts) -> None:
        self.sock.send_multipart([ident, *parts])

    def close(self) -> None:
        self.sock.close(linger=0)


@contextmanager
def zmq_context():
    ctx = zmq.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)
