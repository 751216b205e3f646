"""A large weight file's digest is kept on disk and reused across processes while the file is unchanged."""

from __future__ import annotations

import hashlib
import os

from worker.text import model_source


def _fresh(path):
    model_source._digest.cache_clear()  # a new process: nothing in memory
    return model_source.file_digest(path)


def test_a_large_file_is_hashed_once_across_processes_and_again_after_a_rewrite(tmp_path, monkeypatch):
    monkeypatch.setenv("SWITCHYARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(model_source, "DIGEST_RECORD_MIN_BYTES", 1024)
    weights = tmp_path / "model-00001.safetensors"
    weights.write_bytes(os.urandom(4096))
    first = _fresh(weights)
    assert first == hashlib.sha256(weights.read_bytes()).hexdigest()
    records = list((tmp_path / "cache" / "switchyard" / "digests").glob("*.sha256"))
    assert len(records) == 1

    reads = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: reads.append(str(p)) or real_open(p, *a, **k))
    assert _fresh(weights) == first
    assert str(weights) not in reads  # the record answered

    st = weights.stat()
    weights.write_bytes(os.urandom(4096))  # rewritten in place, the old mtime put back
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert _fresh(weights) == hashlib.sha256(weights.read_bytes()).hexdigest() != first


def test_a_small_file_leaves_no_record(tmp_path, monkeypatch):
    monkeypatch.setenv("SWITCHYARD_CACHE", str(tmp_path / "cache"))
    small = tmp_path / "config.json"
    small.write_text("{}")
    assert _fresh(small) == hashlib.sha256(b"{}").hexdigest()
    assert not (tmp_path / "cache" / "switchyard" / "digests").exists()
