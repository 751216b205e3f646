"""bench/kv_tiers.py on the tiny model: the default JSON line keeps its fields, and `--disk` restores from a
disk tier (in a fresh directory under the one given, removed after the run) and adds the disk fields."""

from __future__ import annotations

import json

import pytest

from bench import kv_tiers
from worker.kvcache.tiers.cost import CostModel

# tiny-model figures say nothing of the targets: --no-targets (exit 0 whatever they say)
SMALL = ["--json", "--no-targets", "--model", "tiny-random", "--dtype", "float32", "--tenants", "6",
         "--system-tokens", "200", "--requests", "8", "--output-tokens", "1", "--pool-factor", "4"]
DISK_FIELDS = {"disk_mode", "disk_fs", "disk_page_cache", "disk_min_hits", "disk_capacity_mb", "disk_writes",
               "disk_write_mb", "disk_write_mb_s", "disk_dropped", "disk_hits", "ram_hits", "disk_reads",
               "disk_read_mb", "disk_read_mb_s", "disk_read_ms_p50", "disk_read_ms_p99", "disk_corrupt",
               "disk_evictions", "disk_tier_mb", "restore_mb_s", "restores", "restore_ms_p50",
               "restore_ms_p99"}


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert kv_tiers.main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture
def always_restore(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model prefills faster than its tiny pages load, so the cost model would refuse most
    restores."""
    monkeypatch.setattr(CostModel, "worth", lambda self, ram, disk, tokens: True)


def test_disk_mode_restores_from_disk_and_reports_it(tmp_path, capsys, always_restore) -> None:
    res = _run([*SMALL, "--disk", "--disk-dir", str(tmp_path)], capsys)
    assert DISK_FIELDS <= res.keys()
    assert res["disk_mode"] is True and res["disk_page_cache"] == "dropped" and res["disk_min_hits"] == 0
    # the RAM tier holds nothing: restores are disk reads
    assert res["ram_hits"] == 0 and res["host_tier_mb"] == 0
    assert res["restores"] > 0 and res["restored_tokens"] > 0 and res["skipped_by_cost"] == 0
    assert (res["disk_hits"] > 0 and res["disk_reads"] > 0 and res["disk_read_mb"] > 0
            and res["disk_read_mb_s"] > 0)
    assert res["disk_writes"] > 0 and res["disk_write_mb"] > 0 and res["disk_write_mb_s"] > 0
    assert res["disk_corrupt"] == 0 and res["disk_tier_mb"] > 0 and res["restore_mb_s"] > 0
    assert 0 < res["disk_read_ms_p50"] <= res["disk_read_ms_p99"]
    assert 0 < res["restore_ms_p50"] <= res["restore_ms_p99"]
    assert res["cached_frac_on"] > res["cached_frac_off"]
    assert not list(tmp_path.iterdir()), "the run's disk tier directory was left behind"


def test_default_mode_has_no_disk_fields(capsys) -> None:
    res = _run(SMALL, capsys)
    assert not [k for k in res if k.startswith("disk_")] and "restores" not in res
    assert res["restored_tokens"] >= 0 and res["host_tier_mb"] >= 0 and "targets_met" in res
