"""The GGUF index cache: the cached tensor table maps the same bytes and metadata as gguf-py's reader, a torn
cache file is parsed again, another file's content never reads this one's index, and a cache that cannot be
written still loads (on small GGUF files written here; every default-model test loads through the index)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from worker.text import gguf_index
from worker.text.model_source import file_digest


@pytest.fixture
def cache(monkeypatch, tmp_path) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("SWITCHYARD_CACHE", str(folder))
    return folder


def write_gguf(path: Path, seed: int = 0) -> Path:
    """A GGUF with scalar metadata, a tokenizer-like string array, an f32 tensor and a Q8_0 one."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_string("general.name", f"tiny-{seed}")
    w.add_token_list([f"tok{i}" for i in range(300)])
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float32))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_down.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _same_as_reader(index: gguf_index.GGUFIndex, path: Path) -> None:
    reader = gguf.GGUFReader(str(path))
    assert index.meta == gguf_index.scalar_metadata(reader) and index.meta["general.name"].startswith("tiny")
    arrays = index.arrays(path)
    assert [t.name for t, _ in arrays] == [t.name for t in reader.tensors] and len(arrays) == 2
    for (t, data), ref in zip(arrays, reader.tensors, strict=True):
        assert t.qtype == int(ref.tensor_type)
        assert data.dtype == ref.data.dtype and data.shape == ref.data.shape
        assert np.array_equal(data, ref.data), t.name
        assert np.array_equal(gguf.quants.dequantize(data, t.qtype),
                              gguf.quants.dequantize(ref.data, ref.tensor_type))


def test_the_cached_table_maps_what_the_reader_reads(cache: Path, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "a.gguf")
    first = gguf_index.read_index(path)
    cached = gguf_index.index_path(path)
    assert cached.is_file() and cached.is_relative_to(cache)
    assert "tok299" not in cached.read_text()  # the tokenizer's arrays are not copied
    second = gguf_index.read_index(path)  # from the file just written
    assert second == first
    _same_as_reader(second, path)


def test_a_torn_index_is_parsed_again_and_rewritten(cache: Path, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "a.gguf")
    good = gguf_index.read_index(path)
    cached = gguf_index.index_path(path)
    cached.write_text(cached.read_text()[:100])
    assert gguf_index.read_index(path) == good
    _same_as_reader(gguf_index.read_index(path), path)


def test_another_files_content_has_its_own_index(cache: Path, tmp_path: Path) -> None:
    a, b = write_gguf(tmp_path / "a.gguf", seed=0), write_gguf(tmp_path / "b.gguf", seed=1)
    assert file_digest(a) != file_digest(b) and gguf_index.index_path(a) != gguf_index.index_path(b)
    gguf_index.read_index(a)
    _same_as_reader(gguf_index.read_index(b), b)
    write_gguf(a, seed=1)  # rewritten in place: now b's bytes, so b's index
    assert gguf_index.index_path(a) == gguf_index.index_path(b)


def test_an_unwritable_cache_still_loads(monkeypatch, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("SWITCHYARD_CACHE", str(blocker))  # switchyard/gguf cannot be made under a file
    path = write_gguf(tmp_path / "a.gguf")
    _same_as_reader(gguf_index.read_index(path), path)


def test_the_index_folder_is_bounded(cache: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(gguf_index, "MAX_FILES", 2)
    paths = [write_gguf(tmp_path / f"m{i}.gguf", seed=i) for i in range(3)]
    for p in paths:
        gguf_index.read_index(p)
    kept = sorted(f.name for f in (cache / "switchyard" / "gguf").iterdir())
    assert len(kept) == 2 and gguf_index.index_path(paths[2]).name in kept
