"""Disaggregated prefill faults, against a scripted fake prefill worker: a stall, stray and malformed frames,
a prefill worker that dies after some pages, a client abort and a refused fingerprint. No request is lost, the
pages that arrived in order are kept, and every page returns to the decode worker's pool."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
import torch
import zmq

from tests.worker.server.disagg_harness import (
    BS,
    FakePrefill,
    Gateway,
    ServerThread,
    first_reply,
    prefix_rows,
    reference,
    zmq_context,
)
from tests.worker.server.disagg_harness import prompt as harness_prompt
from worker import protocol as proto
from worker.model.tiny_model import load_tiny_model
from worker.protocol import KvChunk, PrefillHint, SamplingParams
from worker.server.telemetry import worker_metrics as m

SAMPLING = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_tiny_model(dtype="float32", device="cpu")


@pytest.fixture()
def decode(tiny):
    server = ServerThread(tiny, role="decode", disagg_stall_s=0.5)
    yield server
    server.stop()


def prompt(seed: int, blocks: int) -> list[int]:
    return harness_prompt(seed, blocks * BS + 5)


def count(metric, label: str) -> float:
    return metric.labels(label)._value.get()


def chunk(pf: dict, first: int, rows: np.ndarray | None, dest=None) -> list[bytes]:
    n = 0 if rows is None else len(rows)
    at = first - pf["skip"]
    dest = np.frombuffer(pf["dest"], dtype="<i4")[at:at + n] if dest is None else dest
    header = proto.encode_kv_header(KvChunk(pf["xid"], first, dest, pf["pb"], None))
    return [header, b"" if rows is None else rows.tobytes()]


def run_against(fake: FakePrefill, decode: ServerThread, rid: str, toks: list[int], script) -> list[int]:
    """Send the request to the decode worker hinted at `fake`; `script(ident, pf)` plays the prefill side."""
    with zmq_context() as ctx:
        gw = Gateway(ctx, decode.endpoint)
        gw.sock.send(proto.encode_gen(rid, b"ns", toks, SAMPLING, prefill=PrefillHint("fake", fake.endpoint)))
        ident, pf = fake.next_prefill()
        script(ident, pf)
        out, finish, _ = gw.collect(rid)
        gw.close()
    assert finish == "length"
    return out


def test_stalled_prefill_worker_falls_back_and_frees_pages(tiny, decode) -> None:
    fake = FakePrefill(zmq.Context.instance())
    stalls = count(m.DISAGG_FALLBACKS, "stall")
    toks = prompt(1, 4)
    out = run_against(fake, decode, "stall", toks, lambda ident, pf: None)  # never answers
    assert out == reference(tiny, toks, SAMPLING)
    assert count(m.DISAGG_FALLBACKS, "stall") == stalls + 1
    assert decode.idle()
    fake.close()


def test_stray_frame_is_dropped_and_malformed_chunk_ends_only_its_transfer(tiny, decode) -> None:
    fake = FakePrefill(zmq.Context.instance())
    stray, malformed = m.DISAGG_STRAY._value.get(), count(m.DISAGG_FALLBACKS, "malformed")
    toks = prompt(2, 4)

    def script(ident: bytes, pf: dict) -> None:
        unknown = dict(pf, xid="not-a-transfer")
        fake.send(ident, *chunk(unknown, pf["skip"], None))
        fake.send(ident, *chunk(pf, pf["skip"], np.zeros((1, pf["pb"]), np.uint8),
                                dest=np.array([999_999], "<i4")))

    out = run_against(fake, decode, "bad", toks, script)
    assert out == reference(tiny, toks, SAMPLING)
    assert m.DISAGG_STRAY._value.get() == stray + 1
    assert count(m.DISAGG_FALLBACKS, "malformed") == malformed + 1
    assert decode.idle()
    fake.close()


def test_prefill_worker_dying_midway_keeps_the_pages_that_arrived(tiny, decode) -> None:
    ctx = zmq.Context()
    fake = FakePrefill(ctx)
    lost = count(m.DISAGG_FALLBACKS, "prefill_lost")
    toks = prompt(3, 5)
    rows = prefix_rows(tiny, toks).numpy()
    computed = decode.engine.stats().prefill_tokens_computed

    def script(ident: bytes, pf: dict) -> None:
        fake.send(ident, *chunk(pf, 0, rows[:2]))
        time.sleep(0.2)
        ctx.destroy(linger=0)  # the process is gone: its connection drops

    out = run_against(fake, decode, "dies", toks, script)
    assert out == reference(tiny, toks, SAMPLING)
    assert count(m.DISAGG_FALLBACKS, "prefill_lost") == lost + 1
    # the two pushed blocks were kept: only the rest of the prompt was computed here
    assert decode.engine.stats().prefill_tokens_computed - computed == len(toks) - 2 * BS
    assert decode.idle()


def test_client_abort_during_a_transfer_frees_the_lease_and_tells_the_prefill_worker(tiny, decode) -> None:
    fake = FakePrefill(zmq.Context.instance())
    with zmq_context() as ctx:
        gw = Gateway(ctx, decode.endpoint)
        gw.sock.send(proto.encode_gen("ab", b"ns", prompt(4, 4), SAMPLING,
                                      prefill=PrefillHint("f", fake.endpoint)))
        ident, pf = fake.next_prefill()
        assert decode.engine.pool.num_free < decode.engine.pool.num_pages  # the lease holds pages
        gw.sock.send(proto.encode_abort("ab"))
        until = time.monotonic() + 5
        got = None
        while time.monotonic() < until and got is None:
            if fake.sock.poll(100):
                _, data = fake.sock.recv_multipart()
                obj = msgpack.unpackb(data, raw=False)
                got = obj if obj.get("t") == "pfabort" else None
        assert got is not None and got["xid"] == pf["xid"]
        gw.close()
    assert decode.idle()
    fake.close()


def test_prefill_worker_refuses_a_mismatched_fingerprint(tiny) -> None:
    prefill = ServerThread(tiny, role="prefill")
    try:
        with zmq_context() as ctx:
            sock = ctx.socket(zmq.DEALER)
            sock.connect(prefill.endpoint)
            req = proto.PrefillRequest(xid="x1", ns=b"ns", tokens=np.arange(5, 5 + 3 * BS, dtype=np.int32),
                                       sampling=SAMPLING.to_dict(), skip=0, dest=np.arange(3, dtype=np.int32),
                                       fingerprint=b"\0" * 16,
                                       page_bytes=prefill.engine.exports.codec.page_bytes,
                                       deadline=time.time() + 10)
            sock.send(proto.encode_prefill(req))
            reply = first_reply(sock)
            assert reply is not None and reply.xid == "x1" and reply.reason == "incompatible"
            sock.close(linger=0)
        assert prefill.idle()
    finally:
        prefill.stop()


def test_decode_worker_gone_mid_transfer_frees_the_prefill_workers_pages(tiny) -> None:
    prefill = ServerThread(tiny, role="prefill")
    try:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(prefill.endpoint)
        codec = prefill.engine.exports.codec
        n_blocks = 30  # 8 prefill steps of 64 tokens: the peer leaves after the first pages
        req = proto.PrefillRequest(xid="gone", ns=b"ns", tokens=np.array(prompt(5, n_blocks), dtype=np.int32),
                                   sampling=SAMPLING.to_dict(), skip=0,
                                   dest=np.arange(n_blocks, dtype=np.int32),
                                   fingerprint=prefill.server.prefill.fingerprint,
                                   page_bytes=codec.page_bytes, deadline=time.time() + 30)
        sock.send(proto.encode_prefill(req))
        got = first_reply(sock)
        assert isinstance(got, proto.KvChunk) and got.first == 0 and got.n > 0
        ctx.destroy(linger=0)  # the decode worker is gone
        assert prefill.idle(), "the prefill worker kept the request or its pages"
        assert not prefill.server.prefill.jobs
    finally:
        prefill.stop()


def test_a_busy_prefill_worker_that_keeps_talking_is_not_a_stall(tiny, decode) -> None:
    fake = FakePrefill(zmq.Context.instance())
    stalls = count(m.DISAGG_FALLBACKS, "stall")
    done = count(m.DISAGG_TRANSFERS, "complete")
    toks = prompt(6, 4)
    rows = prefix_rows(tiny, toks).numpy()
    first = reference(tiny, toks, SamplingParams(max_tokens=1, ignore_eos=True))

    def script(ident: bytes, pf: dict) -> None:
        for _ in range(6):  # 1.2 s of queueing, over the 0.5 s stall bound, with its stats flowing
            fake.send(ident, proto.encode_sync())
            time.sleep(0.2)
        fake.send(ident, *chunk(pf, 0, rows))
        last = KvChunk(pf["xid"], len(rows), np.zeros(0, "<i4"), pf["pb"], None,
                       first_token=proto.FirstToken(first, None, 0))
        fake.send(ident, proto.encode_kv_header(last), b"")

    out = run_against(fake, decode, "busy", toks, script)
    assert out == reference(tiny, toks, SAMPLING)
    assert count(m.DISAGG_FALLBACKS, "stall") == stalls
    assert count(m.DISAGG_TRANSFERS, "complete") == done + 1
    assert decode.idle()
    fake.close()


def test_a_silent_decode_peer_hears_that_its_transfer_was_given_up(tiny) -> None:
    """A decode worker whose loop stalls past the prefill worker's gateway timeout: the prefill worker ends
    the transfer with an explicit error (the decode side then prefills locally at once), never a silent abort
    that would leave the decode side waiting for its whole lease."""
    prefill = ServerThread(tiny, role="prefill", gateway_timeout=0.5)
    step = prefill.engine.step

    def slow_step(*args, **kw):  # 0.2 s a step: the 30-block prompt's prefill outlasts the timeout
        time.sleep(0.2)
        return step(*args, **kw)

    prefill.engine.step = slow_step
    try:
        with zmq_context() as ctx:
            sock = ctx.socket(zmq.DEALER)
            sock.connect(prefill.endpoint)
            n_blocks = 30
            req = proto.PrefillRequest(xid="quiet", ns=b"ns",
                                       tokens=np.array(prompt(7, n_blocks), dtype=np.int32),
                                       sampling=SAMPLING.to_dict(), skip=0,
                                       dest=np.arange(n_blocks, dtype=np.int32),
                                       fingerprint=prefill.server.prefill.fingerprint,
                                       page_bytes=prefill.engine.exports.codec.page_bytes,
                                       deadline=time.time() + 30)
            t0 = time.monotonic()
            sock.send(proto.encode_prefill(req))  # then silence: no heartbeat
            error = None
            while error is None and time.monotonic() - t0 < 5:
                reply = first_reply(sock, timeout=0.2)
                if isinstance(reply, proto.KvError):
                    error = reply
            assert error is not None and error.xid == "quiet", "the prefill worker gave up without a word"
            assert time.monotonic() - t0 < 0.5 + 0.2 + 1.0  # the timeout, a step, and housekeeping
        assert prefill.idle()
    finally:
        prefill.engine.step = step
        prefill.stop()


def test_leases_count_against_max_num_seqs(tiny, decode) -> None:
    """A lease is a sequence to come: with every slot taken by running requests and leases, a hinted request
    prefills here, through the fair scheduler's queue, instead of taking a whole prompt's pages outside it."""
    fake = FakePrefill(zmq.Context.instance())
    slots, decode.engine.config.max_num_seqs = decode.engine.config.max_num_seqs, 1
    seqs = count(m.DISAGG_FALLBACKS, "seqs")
    try:
        with zmq_context() as ctx:
            gw = Gateway(ctx, decode.endpoint)
            hint = PrefillHint("fake", fake.endpoint)
            gw.sock.send(proto.encode_gen("first", b"ns", prompt(10, 4), SAMPLING, prefill=hint))
            fake.next_prefill()  # the first request's lease: the only slot
            out, finish, _ = gw.generate("second", prompt(11, 4), SAMPLING, hint)
            assert finish == "length" and len(out) == SAMPLING.max_tokens  # served here, not leased
            assert count(m.DISAGG_FALLBACKS, "seqs") == seqs + 1
            gw.sock.send(proto.encode_abort("first"))
            gw.close()
        assert decode.idle()
    finally:
        decode.engine.config.max_num_seqs = slots
        fake.close()
