"""The environment of the vLLM-engine worker tests: vLLM's CPU build, offline, a small KV space."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def vllm_env() -> Iterator[None]:
    """VLLM_ENV for the processes a test module starts (restored after it)."""
    with pytest.MonkeyPatch.context() as env:
        for key, value in VLLM_ENV.items():
            env.setenv(key, value)
        yield
