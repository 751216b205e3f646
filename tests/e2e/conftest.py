"""Fixtures of the end-to-end tool-call and choices tests: one real gateway, Redis and tiny-model worker
(prefix cache on, worker metrics on a local port) shared by the module, and a tenant's `openai` SDK client."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from config.local_stack.launcher import free_port
from tests.gateway_stack import GatewayStack, start_gateway_stack


@pytest.fixture(scope="module")
def tools_stack() -> Iterator[tuple[GatewayStack, int]]:
    port = free_port()
    gs = start_gateway_stack(worker_model="tiny-random", prefix_cache=True,
                             worker_args=["--metrics-port", str(port), "--metrics-host", "127.0.0.1"])
    try:
        yield gs, port
    finally:
        gs.stack.stop()


@pytest.fixture(scope="module")
def tools_client(tools_stack) -> openai.OpenAI:
    key = tools_stack[0].stack.create_tenant("tools", max_concurrent=128)
    return openai.OpenAI(api_key=key, base_url=tools_stack[0].base_url + "/v1", max_retries=0, timeout=60)
