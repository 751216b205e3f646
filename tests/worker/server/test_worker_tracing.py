"""Worker spans of a traced request (queue, prefill, decode), children of the
gateway's route span, recorded by the real serve loop's admit and step paths with a
tiny engine; untraced requests and tracing off record none."""

from __future__ import annotations

import pytest
import torch

from worker import protocol as proto
from worker.config import EngineConfig
from worker.engine.core import Engine
from worker.model.tiny_model import load_tiny_model
from worker.protocol import SamplingParams
from worker.server.serve import ServerConfig, WorkerServer

TRACE_ID, ROUTE_SPAN = "ab" * 16, "cd" * 8
TRACEPARENT = f"00-{TRACE_ID}-{ROUTE_SPAN}-01"


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_tiny_model(dtype="float32", device="cpu")


def serve(tiny, requests: list[tuple[str, str]]) -> WorkerServer:
    """Admit `requests` (rid, traceparent) through WorkerServer._handle and step until all have ended."""
    server = WorkerServer(Engine(tiny, EngineConfig()), ServerConfig())
    sent: list[bytes] = []
    server._send = lambda ident, payload: sent.append(payload)  # type: ignore[method-assign]
    try:
        for rid, tp in requests:
            frame = proto.encode_gen(rid, b"ns", [5, 6, 7, 8], SamplingParams(max_tokens=4, ignore_eos=True),
                                     traceparent=tp)
            server._handle(b"gw", frame)
        for _ in range(50):
            if not len(server.table):
                break
            server._step()
        assert not len(server.table)
    finally:
        server.engine.close()
        server.sock.close()
        server.ctx.term()
    assert sent  # every request was answered
    return server


def test_traced_request_gets_queue_prefill_and_decode_spans(tiny, spans) -> None:
    serve(tiny, [("traced", TRACEPARENT), ("plain", "")])
    got = {s.name: s for s in spans.get_finished_spans()}
    assert set(got) == {"worker.queue", "worker.prefill", "worker.decode"}  # none for the untraced request
    for span in got.values():
        assert f"{span.context.trace_id:032x}" == TRACE_ID and f"{span.parent.span_id:016x}" == ROUTE_SPAN
    queue, prefill, decode = got["worker.queue"], got["worker.prefill"], got["worker.decode"]
    assert (queue.start_time <= queue.end_time <= prefill.start_time + 1
            and prefill.end_time <= decode.start_time + 1)
    assert decode.end_time >= decode.start_time
    assert decode.attributes["switchyard.completion_tokens"] == 4
    assert decode.attributes["switchyard.finish_reason"] == "length"
    assert prefill.attributes["switchyard.cached_tokens"] == 0


def test_tracing_off_follows_nothing(tiny) -> None:
    server = serve(tiny, [("traced", TRACEPARENT)])
    assert server.spans._tracer is None
    server.spans.admitted("x", TRACEPARENT)
    assert not server.spans._live
