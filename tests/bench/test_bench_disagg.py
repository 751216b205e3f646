"""bench/disagg.py's pure parts: the seeded schedule and prompts,
SLOs and goodput, greedy comparison, pinning."""

from __future__ import annotations

import argparse
import os

import pytest

from bench.disagg import delta
from bench.disagg_workload import (
    Sample,
    Slo,
    Workload,
    against_best,
    goodput,
    greedy_compare,
    long_prompt,
    long_schedule,
    short_turn,
    window_tokens,
)
from bench.machine import pinned


def sample(kind: str, start: float, arrivals: list[float], prompt_len: int = 100, index: int = 0,
           tokens: list[str] | None = None) -> Sample:
    return Sample(kind, index, prompt_len, start, chunks=[(t, 1) for t in arrivals], tokens=tokens or [])


def test_the_long_schedule_is_seeded_poisson_within_the_window() -> None:
    w = Workload(seed=3, duration_s=6000.0, long_mean_gap_s=6.0, long_len=(2048, 4096))
    first, again = long_schedule(w), long_schedule(w)
    assert first == again and first != long_schedule(Workload(seed=4, duration_s=6000.0))
    times = [a.at_s for a in first]
    assert times == sorted(times) and 0 < times[0] and times[-1] < w.duration_s
    assert [a.index for a in first] == list(range(len(first)))
    assert 0.9 < len(first) * w.long_mean_gap_s / w.duration_s < 1.1  # rate 1/6 per second
    assert all(2048 <= a.length <= 4096 for a in first)
    assert (long_prompt(w, first[0]) == long_prompt(w, first[0])
            and len(long_prompt(w, first[0])) == first[0].length)


def test_prompts_are_the_same_per_index_and_share_no_prefix() -> None:
    w = Workload(seed=0)
    assert short_turn(w, 2, 5) == short_turn(Workload(seed=0, duration_s=1.0), 2, 5)
    turns = [short_turn(w, s, t) for s in range(6) for t in range(4)]
    assert all(64 <= len(p) <= 128 and 96 <= n <= 160 for p, n in turns)
    assert len({tuple(p[:4]) for p, _ in turns}) == len(turns)
    assert len({n for _, n in turns}) > 1  # streams do not restart in lockstep


def test_slo_bounds_ttft_by_kind_and_the_request_p99_gap() -> None:
    slo = Slo(ttft_short_s=1.0, ttft_long_base_s=2.0, ttft_long_per_token_s=0.001, itl_p99_s=0.2)
    assert slo.met(sample("short", 0.0, [0.9, 1.0, 1.1]))
    assert not slo.met(sample("short", 0.0, [1.5, 1.6]))  # TTFT
    assert slo.met(sample("long", 0.0, [4.9, 5.0], prompt_len=3000))  # 2 + 3 s
    assert not slo.met(sample("long", 0.0, [5.1, 5.2], prompt_len=3000))
    assert not slo.met(sample("short", 0.0, [0.1, 0.2, 0.8]))  # one 0.6 s gap of two: p99 over 0.2
    assert not slo.met(sample("short", 0.0, []))
    failed = sample("short", 0.0, [0.1])
    failed.error = "HTTP 503"
    assert not slo.met(failed)


def test_goodput_and_throughput_count_the_window_only() -> None:
    slo = Slo(ttft_short_s=1.0, itl_p99_s=1.0)
    samples = [sample("short", 10.0, [10.5, 11.0]), sample("short", 12.0, [14.0]),  # second misses TTFT
               # before and after the window
               sample("short", 9.0, [9.5]), sample("short", 30.0, [30.2, 30.4])]
    assert goodput(samples, slo, t0=10.0, duration_s=10.0) == pytest.approx(0.1)
    assert window_tokens(samples, t0=10.0, duration_s=10.0) == 3


def test_greedy_compare_reports_the_first_differing_token() -> None:
    a = [sample("long", 0, [1.0], index=i, tokens=["a", "b", "c"]) for i in range(3)]
    b = [sample("long", 0, [1.0], index=0, tokens=["a", "b", "c"]),
         sample("long", 0, [1.0], index=1, tokens=["a", "x", "c"]), sample("short", 0, [1.0], index=2)]
    assert greedy_compare(a, b) == {"compared": 2, "identical": 1, "tokens": 6,
                                    "first_difference": {"1": 1}}


def test_metric_deltas_and_pinning() -> None:
    after = {"requests": {"remote": 5.0, "local": 3.0}, "workers": [{"stall": 1.0}, {}]}
    before = {"requests": {"remote": 1.0, "local": 3.0}, "workers": [{}, {}]}
    assert delta(after, before) == {"requests": {"remote": 4.0}, "workers": [{"stall": 1.0}, {}]}
    mask = os.sched_getaffinity(0)
    with pinned(min(mask)):
        assert os.sched_getaffinity(0) == {min(mask)}
    assert os.sched_getaffinity(0) == mask


def test_counters_read_totals_by_label_and_unlabelled(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import disagg

    text = ('switchyard_disagg_requests_total{outcome="remote"} 4.0\n'
            'switchyard_disagg_requests_total{outcome="local"} 7.0\n'
            'switchyard_disagg_requests_created{outcome="local"} 1.7e9\n'
            'switchyard_worker_disagg_pushed_bytes_total 2097152.0\n')
    monkeypatch.setattr(disagg.httpx, "get", lambda *a, **k: type("R", (), {"text": text})())
    assert disagg.counters("u", "switchyard_disagg_requests", "outcome") == {"remote": 4.0, "local": 7.0}
    assert disagg.transfer_mib("u") == {"pushed": 2.0}


def _arm(errors: int, fallbacks: int = 0, itl_p99: float = 20.0, tok_s: float = 100.0) -> dict:
    stats = {"p50": 10.0, "p99": itl_p99}
    return {"itl_ms": stats, "ttft_long_ms": stats, "ttft_short_ms": stats, "output_tok_s": tok_s,
            "goodput_rps": 1.0, "errors": errors, "other_cpu_s": 0.0,
            "metrics": {"worker_fallbacks": [{"busy": float(fallbacks)}]}}


def _args(chunks: list[int]) -> argparse.Namespace:
    return argparse.Namespace(model="m", dtype="float32", quantization="none", kv_dtype="model",
                              kv_cache_mib=1, disagg_min_tokens=1, disagg_max_prefill_queue=1, stall_s=None,
                              prefill_chunk=chunks)


@pytest.mark.parametrize(("co_errors", "dis_errors", "fallbacks", "ok"),
                         [(0, 0, 0, True), (1, 0, 0, False), (0, 2, 0, False), (0, 0, 3, False)])
def test_errors_and_fallbacks_miss_the_targets(co_errors: int, dis_errors: int, fallbacks: int,
                                               ok: bool) -> None:
    from bench import disagg

    out = disagg.summary({"colocated@256": _arm(co_errors), "disagg": _arm(dis_errors, fallbacks)},
                         {"compared": 1, "identical": 1}, _args([256]), Workload(), Slo())
    assert out["prefill_chunks"] == [256] and out["worker_fallbacks"] == fallbacks
    assert (out["met"]["no_errors"] and out["met"]["no_fallbacks"]) is ok
    assert out["dtype"] == "float32" and out["kv_dtype"] == "model" and out["speculation"] == "off"


def test_each_ratio_is_against_the_colocated_chunk_best_at_it() -> None:
    from bench import disagg

    # a 128-token chunk gives the colocated arm a short ITL tail but less throughput than a 1,024-token one
    arms = {"colocated@1024": _arm(0, itl_p99=3000.0, tok_s=40.0), "colocated@128": _arm(0, itl_p99=400.0),
            "disagg": _arm(0, itl_p99=300.0, tok_s=60.0)}
    out = disagg.summary(arms, {"compared": 0, "identical": 0}, _args([1024, 128]), Workload(), Slo())
    assert out["by_chunk"]["1024"]["itl_p99_ratio"] == 0.1 and out["by_chunk"]["128"]["itl_p99_ratio"] == 0.75
    assert out["itl_p99_ratio"] == 0.75 and out["throughput_ratio"] == 0.6  # the worst of the two
    assert not out["met"]["itl_p99"] and not out["met"]["throughput"]
    missing = {"1": {"itl_p99_ratio": None}, "2": {"itl_p99_ratio": 0.1}}
    assert against_best(missing) == {"itl_p99_ratio": None}


def test_the_chunk_flag_takes_a_comma_list() -> None:
    from bench.disagg import chunk_list

    assert chunk_list("1024,256,128") == [1024, 256, 128] and chunk_list("512") == [512]
    with pytest.raises(argparse.ArgumentTypeError):
        chunk_list("0")
