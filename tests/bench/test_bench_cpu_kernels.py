"""bench/cpu_kernels.py: each section measures both sides on the same inputs and reports their ratio."""

from __future__ import annotations

import json

import torch

from bench import cpu_kernels


def test_sections_report_both_sides_and_the_ratio():
    s = cpu_kernels.sampler(2, reps=1)
    assert s["rows"] == 2 and s["torch_ms"] > 0 and s["kernel_ms"] > 0 and s["speedup"] > 0
    r = cpu_kernels.restriction(2, reps=1)
    assert r["full_sort_ms"] > 0 and r["candidates_ms"] > 0
    a = cpu_kernels.attention(2, 40, torch.float32, reps=1)
    assert a["context"] == 40 and a["torch_ms"] > 0 and a["kernel_ms"] > 0


def test_full_sort_baseline_keeps_the_same_nucleus():
    logits = torch.randn(3, cpu_kernels.VOCAB, generator=torch.Generator().manual_seed(5)) * 6
    base = torch.isfinite(cpu_kernels.full_sort_restrict(logits, 0, 0.95))
    ours = torch.isfinite(cpu_kernels.restrict_logits(logits, torch.zeros(3, dtype=torch.int64),
                                                      torch.full((3,), 0.95)))
    assert (base != ours).sum().item() <= 3


def test_main_prints_one_json_line(capsys):
    assert cpu_kernels.main(["--reps", "1", "--json"]) == 0
    line = json.loads(capsys.readouterr().out.strip())
    assert line["bench"] == "cpu_kernels" and len(line["sampler"]) == 3 and "loadavg_1m" in line
    assert [a["context"] for a in line["decode_attention"]] == [128, 512, 1024]
