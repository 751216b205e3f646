"""`bench/open_loop.py` without a server: the Poisson schedule and the goodput arithmetic."""

from __future__ import annotations

import statistics

from bench import open_loop


def test_arrivals_are_seeded_poisson_at_the_rate() -> None:
    starts = open_loop.arrivals(4.0, 2000, seed=3)
    assert starts == open_loop.arrivals(4.0, 2000, seed=3) and starts != open_loop.arrivals(4.0, 2000, seed=4)
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert starts[0] == 0.0 and all(g >= 0 for g in gaps)
    assert abs(statistics.mean(gaps) - 0.25) < 0.02  # exponential gaps of mean 1/rate
    assert abs(statistics.pstdev(gaps) - 0.25) < 0.03  # ... and standard deviation 1/rate


def test_goodput_counts_only_requests_meeting_both_slos() -> None:
    results = [{"ttft": 0.5, "tpot": 0.05, "out": 10},  # good
               {"ttft": 2.5, "tpot": 0.05, "out": 10},  # TTFT missed
               {"ttft": 0.5, "tpot": 0.30, "out": 10},  # TPOT missed
               {"ttft": 0.2, "tpot": None, "out": 1},  # one token: TTFT alone decides
               {"error": "short", "body": "3 of 16 tokens"}]
    row = open_loop.summary(2.0, results, wall=4.0, slo_ttft=2.0, slo_tpot=0.2)
    assert row["ok"] == 4 and row["errors"] == 1
    assert row["goodput_rps"] == 0.5 and row["slo_met_frac"] == 0.4  # 2 good of 5, over 4 s
    assert row["out_tok_s"] == 7.8 and row["ttft_p50_ms"] == 500.0
