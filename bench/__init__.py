"""Benchmark harnesses; each prints one JSON line with ratios against a same-run baseline."""
