"""The gateway's `kv_event_feeds` setting subscribes its router to KV event publishers: a configured
vLLM-format publisher's blocks reach the router's index, and a bad entry is refused when the settings load."""

from __future__ import annotations

import asyncio
import types

import pydantic
import pytest
import zmq

from config.cmd_gateway import _start_kv_feeds
from config.settings import GatewaySettings
from router.placement.kv_index import KvIndex
from tests.router.test_router_kv_feed import FakeVllm, stored


async def test_a_configured_feed_fills_the_router_index() -> None:
    ctx = zmq.Context()
    vllm = FakeVllm(ctx)
    pub, rep = vllm.endpoints()
    gw = GatewaySettings(block_size=4, kv_event_feeds=[{"worker_id": "v1", "endpoint": pub,
                                                         "replay_endpoint": rep, "hashes": "switchyard"}])
    router = types.SimpleNamespace(kv=types.SimpleNamespace(index=KvIndex()))
    stop = _start_kv_feeds(gw, router, None)
    try:
        await asyncio.sleep(0.3)  # the subscription reaches the PUB socket
        vllm.send(0, [stored([7, 8], [0] * 8)])
        async with asyncio.timeout(5):
            while router.kv.index.blocks("v1") < 2:
                await asyncio.sleep(0.02)
    finally:
        await stop()
        vllm.close()
        ctx.term()


def test_a_feed_without_a_zeromq_endpoint_is_refused() -> None:
    with pytest.raises(pydantic.ValidationError, match="endpoint"):
        GatewaySettings(kv_event_feeds=[{"worker_id": "v1", "endpoint": "http://x"}])
