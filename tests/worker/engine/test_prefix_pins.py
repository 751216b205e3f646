"""Pinned prefixes: pages a prefill worker pushed stay cached while their request waits, and the pin ends
with the request's admission or its end (abort, finish), so no lock is leaked. KV tiers are off here, so an
evicted page is gone."""

from __future__ import annotations

import random

import pytest
import torch

from tests.worker.engine.test_prefix_cache_engine import (
    assert_no_leaks,
    drain,
    greedy,
    make_engine,
    rand_prompt,
)
from worker.engine.core import DEFAULT_NAMESPACE
from worker.model.tiny_model import load_tiny_model

BS = 16


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_tiny_model(dtype="float32", device="cpu")


def cached_prompt(engine, rng: random.Random, n: int) -> list[int]:
    """A prompt whose pages the cache holds (as after a transfer): served once, then unlocked and
    evictable."""
    prompt = rand_prompt(rng, n)
    engine.add_request("warm", prompt, greedy(1))
    drain(engine)
    assert engine.cache.peek(DEFAULT_NAMESPACE, prompt) == n - n % BS and engine.cache.locked_pages == 0
    return prompt


def test_a_pinned_prefix_survives_eviction_until_its_request_is_admitted(tiny):
    engine = make_engine(tiny, pages=64, kv_host_bytes=0)
    prompt = cached_prompt(engine, random.Random(1), 5 * BS + 3)
    engine.add_request("b", prompt + [7, 8], greedy(2))
    assert engine.pins.pin("b", DEFAULT_NAMESPACE, prompt[:5 * BS]) == 5 * BS
    assert engine.cache.locked_pages == 5 and len(engine.pins) == 1
    engine.cache.evict(engine.pool.num_pages)  # memory pressure before the scheduler gets to "b"
    assert engine.cache.peek(DEFAULT_NAMESPACE, prompt) == 5 * BS  # nothing pinned was evicted
    out = {o.rid: o for o in engine.step()}
    # admitted: its own match holds them now
    assert out["b"].cached_tokens == 5 * BS and len(engine.pins) == 0
    drain(engine)
    assert_no_leaks(engine)


def test_without_a_pin_the_same_pressure_evicts_the_prefix(tiny):
    engine = make_engine(tiny, pages=64, kv_host_bytes=0)
    prompt = cached_prompt(engine, random.Random(2), 5 * BS + 3)
    engine.add_request("b", prompt + [7, 8], greedy(2))
    engine.cache.evict(engine.pool.num_pages)
    out = {o.rid: o for o in engine.step()}
    assert out["b"].cached_tokens == 0  # the pages were gone: recomputed
    drain(engine)
    assert_no_leaks(engine)


def test_abort_and_failure_paths_release_the_pin(tiny):
    engine = make_engine(tiny, pages=64, kv_host_bytes=0)
    prompt = cached_prompt(engine, random.Random(3), 3 * BS)
    engine.add_request("b", prompt + [9], greedy(2))
    assert engine.pins.pin("b", DEFAULT_NAMESPACE, prompt) == 3 * BS
    assert engine.pins.pin("b", DEFAULT_NAMESPACE, prompt) == 0  # one pin per request
    assert engine.abort("b") and len(engine.pins) == 0 and engine.cache.locked_pages == 0
    assert engine.pins.pin("c", DEFAULT_NAMESPACE, []) == 0  # nothing kept: nothing to pin
    assert engine.pins.pin("d", DEFAULT_NAMESPACE, rand_prompt(random.Random(4), BS)) == 0  # not cached
    drain(engine)
    assert_no_leaks(engine)
