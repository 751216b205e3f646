"""The W8A8 calibration cache: a second load reads the maxima the first measured (same values, no prefill); a
corrupt or mismatched file is measured again; another model or token list is another key."""

from __future__ import annotations

import pytest
import torch

from worker.model.llama import activation_maxima
from worker.model.tiny_model import load_tiny_model
from worker.quant import calibration_cache as cc
from worker.text.model_source import prune_oldest


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return load_tiny_model(dtype="float32", device="cpu").model


@pytest.fixture()
def tiny(model, tmp_path, monkeypatch):
    monkeypatch.setattr(cc, "cache_dir", lambda: tmp_path / "calibration")  # the tokenizer cache stays put
    return model


def test_second_call_reads_what_the_first_measured(tiny) -> None:
    ids = list(range(5, 60))
    calls = []

    def measure():
        calls.append(1)
        return activation_maxima(tiny, ids)

    first = cc.cached_maxima(tiny, ids, measure)
    second = cc.cached_maxima(tiny, ids, measure)
    assert len(calls) == 1 and first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    cc.cached_maxima(tiny, ids[:-1], measure)  # other tokens: another key
    assert len(calls) == 2


def test_corrupt_or_mismatched_files_are_measured_again(tiny) -> None:
    ids = list(range(5, 40))
    measured = activation_maxima(tiny, ids)
    path = cc.cache_dir() / f"act-max-{cc.model_key(tiny, ids)}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"not a torch file")
    calls = []
    got = cc.cached_maxima(tiny, ids, lambda: calls.append(1) or measured)
    assert calls and got is measured
    bad = {k: torch.ones(v.numel() + 1) for k, v in measured.items()}  # wrong width for every layer
    torch.save(bad, path)
    calls.clear()
    assert cc.cached_maxima(tiny, ids, lambda: calls.append(1) or measured) is measured and calls


def test_the_key_follows_the_weights(tiny) -> None:
    ids = [1, 2, 3]
    before = cc.model_key(tiny, ids)
    with torch.no_grad():
        tiny.layers[0].o.weight[0, 0] += 1
        changed = cc.model_key(tiny, ids)
        tiny.layers[0].o.weight[0, 0] -= 1
    assert changed != before


def test_old_files_are_pruned(tmp_path) -> None:
    """Each kind of file is bounded on its own: pruning the maxima leaves the kernel choices, and the
    reverse."""
    folder = tmp_path
    for i in range(cc.MAX_FILES + 5):
        (folder / f"act-max-{i:04d}.pt").write_bytes(b"x")
        (folder / f"kernel-choices-{i:04d}.json").write_text("{}")
    prune_oldest(folder, "act-max-*.pt", cc.MAX_FILES)
    assert len(list(folder.glob("act-max-*.pt"))) == cc.MAX_FILES
    assert len(list(folder.glob("kernel-choices-*.json"))) == cc.MAX_FILES + 5
    prune_oldest(folder, "kernel-choices-*.json", cc.MAX_FILES)
    assert len(list(folder.glob("kernel-choices-*.json"))) == cc.MAX_FILES
