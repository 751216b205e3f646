"""Kernel choices kept on disk (`worker.quant.calibrate`, `calibration_cache.load_choices`): a restart times
nothing and chooses as before; a bad file, another thread count or SWITCHYARD_RECALIBRATE means measuring
again."""

from __future__ import annotations

import json

import pytest
import torch

from worker.quant import calibrate as cal
from worker.quant import calibration_cache as cache
from worker.quant.weights import QuantLinear


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache folder and a process that has measured nothing."""
    monkeypatch.setenv("SWITCHYARD_CACHE", str(tmp_path))
    monkeypatch.delenv(cache.RECALIBRATE_ENV, raising=False)
    monkeypatch.delenv(cal.MAX_ROWS_ENV, raising=False)
    monkeypatch.setattr(cal, "_CALIBRATED", {})
    monkeypatch.setattr(cal, "_measured", False)
    return tmp_path


def _restart(monkeypatch) -> None:
    """What a new process sees: nothing in memory, then the stored choices."""
    monkeypatch.setattr(cal, "_CALIBRATED", {})
    cal.restore_choices()


def _lin() -> QuantLinear:
    return QuantLinear(torch.randn(64, 32, dtype=torch.bfloat16) * 0.05, "int8")


def test_a_restart_reads_the_choice_instead_of_timing(fresh, monkeypatch):
    # the int8 kernel wins at 1 and 2 rows, loses at 4: cutoff 2
    monkeypatch.setattr(cal, "_measure_max_rows", lambda lin, candidates: 2)
    assert cal.calibrate_max_rows(_lin(), candidates=(1, 2, 4)) == 2
    cal.save_choices()
    assert cache.choices_path().exists()
    _restart(monkeypatch)
    monkeypatch.setattr(cal, "_measure_max_rows", lambda lin,
                        candidates: pytest.fail("timed after a restart"))
    assert cal.calibrate_max_rows(_lin(), candidates=(1, 2, 4)) == 2
    other = QuantLinear(torch.randn(96, 32, dtype=torch.bfloat16) * 0.05, "int8")  # a shape never measured
    monkeypatch.setattr(cal, "_measure_max_rows", lambda lin, candidates: 1)
    assert cal.calibrate_max_rows(other, candidates=(1, 2, 4)) == 1


def test_nothing_is_written_when_nothing_was_measured(fresh, monkeypatch):
    cal.save_choices()
    assert not cache.choices_path().exists()


@pytest.mark.parametrize("text", ["{not json", json.dumps({"max_rows|x": "2"}), json.dumps([1, 2])])
def test_a_bad_file_is_measured_again(fresh, monkeypatch, caplog, text):
    path = cache.choices_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    assert cache.load_choices() == {}
    assert "ignoring kernel choices" in caplog.text


def test_recalibrate_ignores_the_file(fresh, monkeypatch):
    cache.store_choices({"small|vnni|576|960": 32})
    assert cache.load_choices() == {"small|vnni|576|960": 32}
    monkeypatch.setenv(cache.RECALIBRATE_ENV, "1")
    assert cache.load_choices() == {}


def test_the_file_is_per_thread_count(fresh):
    threads = torch.get_num_threads()
    try:
        here = cache.choices_path()
        torch.set_num_threads(threads + 1)
        assert cache.choices_path() != here
    finally:
        torch.set_num_threads(threads)


def test_an_unwritable_cache_only_logs(fresh, monkeypatch, caplog):
    blocker = fresh / "switchyard"
    blocker.write_text("a file where the folder should be")
    monkeypatch.setattr(cal, "_measure_max_rows", lambda lin, candidates: 4)
    assert cal.calibrate_max_rows(_lin(), candidates=(1, 2, 4)) == 4
    cal.save_choices()
    assert "could not write the kernel choices" in caplog.text
