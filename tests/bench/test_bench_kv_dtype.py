"""bench/kv_dtype.py: the decode-step timing runs both KV dtypes on
the same shape, and capacity counts tokens."""

from __future__ import annotations

from bench import kv_dtype
from worker.model.loader import load_any


def test_step_ratio_and_capacity_on_the_tiny_model():
    lm = load_any("tiny-random", dtype="float32", device="cpu")
    steps = kv_dtype.step_ratio(lm, rows=2, context=40, reps=1)
    assert steps["step_ms_model"] > 0 and steps["step_ms_int8"] > 0
    assert steps["ratio"] > 0
    cap = kv_dtype.capacity(lm)
    assert cap["capacity_tokens_int8"] > 3.5 * cap["capacity_tokens_model"] and cap["capacity_ratio"] > 3.5
