"""Disaggregated prefill between two real worker servers: the decode worker leases pages, the prefill worker
pushes them, and greedy output matches a worker doing both; pages all return to their pools."""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from tests.worker.server.disagg_harness import BS, Gateway, ServerThread, prompt, reference, zmq_context
from worker import protocol as proto
from worker.model.tiny_model import load_tiny_model
from worker.protocol import PrefillHint, SamplingParams
from worker.server.telemetry import worker_metrics as m


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_tiny_model(dtype="float32", device="cpu")


@pytest.fixture()
def pair(tiny):
    prefill, decode = ServerThread(tiny, role="prefill"), ServerThread(tiny, role="decode")
    yield prefill, decode
    prefill.stop()
    decode.stop()


def test_disaggregated_greedy_matches_colocated_and_frees_pages(tiny, pair) -> None:
    prefill, decode = pair
    hint = PrefillHint("prefill-w", prefill.endpoint)
    sampling = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True)
    done = m.DISAGG_TRANSFERS.labels("complete")._value.get()
    with zmq_context() as ctx:
        gw = Gateway(ctx, decode.endpoint)
        toks = prompt(1, 5 * BS + 7)
        out, finish, items = gw.generate("r1", toks, sampling, hint)
        assert out == reference(tiny, toks, sampling) and finish == "length"
        assert items[0].logprobs is not None and len(items[0].logprobs) == len(items[0].tokens) == 1
        # a second prompt sharing three blocks: the decode worker holds them and leases only the rest
        toks2 = toks[:3 * BS] + prompt(2, 40)
        out2, _, items2 = gw.generate("r2", toks2, sampling, hint)
        assert out2 == reference(tiny, toks2, sampling)
        assert items2[0].cached_tokens >= 3 * BS
        gw.close()
    assert m.DISAGG_TRANSFERS.labels("complete")._value.get() == done + 2
    assert decode.idle() and prefill.idle()
    # the pushed pages are the decode worker's cache now: the whole prompt's full blocks
    assert decode.engine.cache.peek(b"ns", toks[:5 * BS]) == 5 * BS


def test_a_client_gone_mid_prefill_frees_both_workers_within_a_second(tiny, pair) -> None:
    """The gateway aborts a disaggregated request while the prefill worker is still computing it: the decode
    worker drops its lease and tells the prefill worker, which stops; both are idle within a second."""
    prefill, decode = pair
    step = prefill.engine.step

    def slow_step(*args, **kw):  # 0.1 s a step: a 30-block prompt takes about 3 s to prefill
        time.sleep(0.1)
        return step(*args, **kw)

    prefill.engine.step = slow_step
    try:
        with zmq_context() as ctx:
            gw = Gateway(ctx, decode.endpoint)
            gw.sock.send(proto.encode_gen("gone", b"ns", prompt(9, 30 * BS), SamplingParams(max_tokens=4),
                                          prefill=PrefillHint("prefill-w", prefill.endpoint)))
            until = time.monotonic() + 5
            while not prefill.engine.has_work() and time.monotonic() < until:
                time.sleep(0.01)
            assert prefill.engine.has_work() and decode.server.decode.leases  # mid-prefill, lease held
            gw.sock.send(proto.encode_abort("gone"))
            t0 = time.monotonic()
            assert decode.idle(timeout=1.0) and prefill.idle(timeout=1.0)
            assert time.monotonic() - t0 < 1.0
            gw.close()
    finally:
        prefill.engine.step = step


def test_first_token_ends_a_one_token_request(tiny, pair) -> None:
    prefill, decode = pair
    with zmq_context() as ctx:
        gw = Gateway(ctx, decode.endpoint)
        toks = prompt(3, 3 * BS + 1)
        sampling = SamplingParams(max_tokens=1, ignore_eos=True)
        out, finish, _ = gw.generate("one", toks, sampling, PrefillHint("prefill-w", prefill.endpoint))
        assert out == reference(tiny, toks, sampling) and finish == "length"
        gw.close()
    assert decode.idle() and prefill.idle()


def test_short_prompt_or_cached_prompt_prefills_locally(tiny, pair) -> None:
    prefill, decode = pair
    before = m.DISAGG_FALLBACKS.labels("short")._value.get()
    with zmq_context() as ctx:
        gw = Gateway(ctx, decode.endpoint)
        toks = prompt(4, BS - 3)  # no full block: nothing to transfer
        sampling = SamplingParams(max_tokens=4, ignore_eos=True)
        out, _, _ = gw.generate("short", toks, sampling, PrefillHint("prefill-w", prefill.endpoint))
        assert out == reference(tiny, toks, sampling)
        gw.close()
    assert m.DISAGG_FALLBACKS.labels("short")._value.get() == before + 1
    assert not prefill.engine.stats().prompt_tokens  # the prefill worker never saw it


def test_worker_to_worker_link_is_curve_authenticated(tiny) -> None:
    """With a cluster key both ports are CURVE servers: the decode worker's link presents the cluster key pair
    and the transfer completes; a prefill worker under another key never answers, so the decode worker
    prefills."""
    _, secret = zmq.curve_keypair()
    _, other = zmq.curve_keypair()
    key = secret.decode()
    prefill = ServerThread(tiny, role="prefill", cluster_key=key)
    stranger = ServerThread(tiny, role="prefill", cluster_key=other.decode())
    decode = ServerThread(tiny, role="decode", cluster_key=key, disagg_stall_s=0.5)
    done = m.DISAGG_TRANSFERS.labels("complete")._value.get()
    stalls = m.DISAGG_FALLBACKS.labels("stall")._value.get()
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    try:
        with zmq_context() as ctx:
            gw = Gateway(ctx, decode.endpoint, cluster_key=key)
            toks = prompt(11, 4 * BS + 3)
            out, _, _ = gw.generate("curve", toks, sampling, PrefillHint("prefill-w", prefill.endpoint))
            assert out == reference(tiny, toks, sampling)
            assert m.DISAGG_TRANSFERS.labels("complete")._value.get() == done + 1
            out, _, _ = gw.generate("forged", toks[::-1], sampling, PrefillHint("x", stranger.endpoint))
            assert out == reference(tiny, toks[::-1], sampling)
            assert m.DISAGG_FALLBACKS.labels("stall")._value.get() == stalls + 1
            # it never took work from an unauthenticated link
            assert not stranger.engine.stats().prompt_tokens
            gw.close()
        assert decode.idle() and prefill.idle()
    finally:
        for server in (prefill, stranger, decode):
            server.stop()
