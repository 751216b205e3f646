"""KV tiers: the page codec's round trip (model dtype and int8 with scales), the host tier's LRU bound, and
the disk tier's checksums, foreign fingerprints, size bound, full disk and restart."""

from __future__ import annotations

import errno
import os
import pathlib
import time

import pytest
import torch

from worker.config import ModelConfig
from worker.kvcache.tensors import KVCache
from worker.kvcache.tiers import disk as disk_module
from worker.kvcache.tiers.disk import DiskTier
from worker.kvcache.tiers.host import HostTier, TierPage
from worker.kvcache.tiers.pages import PageCodec, fingerprint

BS = 4
CPU = torch.device("cpu")


def _kv(kv_dtype: str, dtype: torch.dtype = torch.float32, pages: int = 8) -> KVCache:
    cfg = ModelConfig(vocab_size=10, hidden_size=16, intermediate_size=8, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    kv = KVCache(cfg, pages, BS, dtype, CPU, kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(1)
    for t in kv.k + kv.v:
        if kv.quantized:
            t.copy_(torch.randint(-127, 128, t.shape, generator=g, dtype=torch.int8))
        else:
            t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    for s in kv.k_scale + kv.v_scale:
        s.copy_(torch.rand(s.shape, generator=g))
    return kv


def _page(kv: KVCache, p: int) -> list[torch.Tensor]:
    sl = slice(p * BS, (p + 1) * BS)
    out = [t[:, sl].clone() for t in kv.k + kv.v]
    return out + [s[:, p].clone() for s in kv.k_scale + kv.v_scale]


@pytest.mark.parametrize("kv_dtype,dtype", [("model", torch.float32), ("model", torch.bfloat16),
                                            ("int8", torch.float32)])
def test_codec_round_trip_is_bit_identical(kv_dtype, dtype):
    kv = _kv(kv_dtype, dtype)
    codec = PageCodec(kv)
    rows = codec.read([5, 2])
    assert rows.shape == (2, codec.page_bytes) and rows.dtype == torch.uint8
    want = [_page(kv, 5), _page(kv, 2)]
    codec.write([0, 7], rows)
    for got, exp in zip([_page(kv, 0), _page(kv, 7)], want, strict=True):
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a,
                   b in zip(got, exp, strict=True))
    assert not torch.equal(_page(kv, 1)[0], want[0][0])  # other pages untouched (and the check can fail)


@pytest.mark.parametrize("kv_dtype,dtype,part,value", [
    ("model", torch.float32, 0, float("nan")), ("model", torch.bfloat16, 1, float("inf")),
    ("int8", torch.float32, 2, float("nan")), ("int8", torch.float32, 3, -1.0)])
def test_pages_from_a_peer_with_numbers_no_page_holds_are_refused(kv_dtype, dtype, part, value):
    codec = PageCodec(_kv(kv_dtype, dtype))
    rows = codec.read([1, 3])
    assert codec.finite(rows)
    codec._parts(rows)[part][-1, -1].view(-1)[-1] = value  # K, V, then the K and V scales
    assert not codec.finite(rows)


def test_fingerprint_names_weights_dtype_layout_model_and_tokenizer():
    a, b = _kv("model"), _kv("int8")
    fp = fingerprint("m", "w1", "tok1", a)
    assert fp == fingerprint("m", "w1", "tok1", _kv("model"))
    assert len({fp, fingerprint("m", "w1", "tok1", b), fingerprint("m2", "w1", "tok1", a),
                fingerprint("m", "w1", "tok2", a), fingerprint("m", "w2", "tok1", a),
                fingerprint("m", "w1", "tok1", _kv("model", torch.bfloat16))}) == 6


def test_weights_id_names_the_file_bytes_quantization_and_version(tmp_path):
    """The same GGUF name with other bytes, another quantization mode or version label: another weights id."""
    from worker.model.build import LoadedModel
    from worker.text.model_source import ModelSource, weights_digest

    def ident(data: bytes, name: str = "X.Q4_1.gguf", quant: str = "none", version: str = "") -> str:
        path = tmp_path / data.hex() / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
        digest = weights_digest(ModelSource("gguf", path, "X"))
        return LoadedModel(None, None, None, "X", "t", 1, torch.float32, torch.device("cpu"), quant, digest,
                           version).weights_id

    base = ident(b"one")
    assert base == ident(b"one")
    assert len({base, ident(b"two"), ident(b"one", quant="w8a8"), ident(b"one", version="v2")}) == 4


def test_stale_format_directories_are_pruned_and_current_ones_kept(tmp_path):
    """A directory of the format whose fingerprint named no weights is deleted when a tier starts; a directory
    of the current format (another model's) is left as it is."""
    from worker.kvcache.tiers.disk import MAGIC, STALE_MAGICS

    def plant(magic: bytes) -> pathlib.Path:
        folder = tmp_path / os.urandom(16).hex()
        (folder / "ab").mkdir(parents=True)
        (folder / "ab" / ("ab" * 16 + ".kv")).write_bytes(magic + b"\0" * 64)
        return folder

    stale, other = plant(STALE_MAGICS[0]), plant(MAGIC)
    tier = DiskTier(tmp_path, 1 << 20, fingerprint("m", "w", "t", _kv("model")))
    try:
        assert not stale.exists() and other.exists() and tier.dir.exists()
    finally:
        tier.close()


def _tp(n: int, fill: int = 0) -> TierPage:
    return TierPage(torch.full((n,), fill, dtype=torch.uint8))


def test_host_tier_is_lru_and_bounded():
    host = HostTier(300)
    assert host.put(b"a", _tp(100)) == [] and host.put(b"b", _tp(100)) == []
    assert host.put(b"c", _tp(100)) == []
    assert host.get(b"a") is not None  # a is now the most recent
    out = host.put(b"d", _tp(100))
    assert [k for k, _ in out] == [b"b"] and host.bytes == 300 and len(host) == 3
    out = host.put(b"e", _tp(250))
    assert {k for k, _ in out} == {b"c", b"a", b"d"} and host.bytes == 250 and host.evictions == 4
    out = host.put(b"f", _tp(301))  # larger than the whole tier: refused, nothing else leaves
    assert [k for k, _ in out] == [b"f"] and b"f" not in host and b"e" in host and host.bytes == 250


def _disk(tmp_path: pathlib.Path, cap: int = 1 << 20, fp: bytes = b"F" * 16) -> DiskTier:
    return DiskTier(tmp_path, cap, fp, queue_pages=8)


def _key(i: int) -> bytes:
    return bytes([i]) * 16


def test_disk_round_trip_and_restart(tmp_path):
    d = _disk(tmp_path)
    data = torch.arange(200, dtype=torch.uint8)
    assert d.submit(_key(1), data)
    d.flush()
    assert torch.equal(d.load(_key(1)), data) and d.writes == 1
    d.close()
    again = _disk(tmp_path)  # a new process finds the file
    assert _key(1) in again and torch.equal(again.load(_key(1)), data)
    again.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_a_bad_file_reads_as_a_miss_and_is_deleted(tmp_path, damage):
    d = _disk(tmp_path)
    d.submit(_key(2), torch.arange(200, dtype=torch.uint8))
    d.flush()
    path = next(d.dir.glob("*/*.kv"))
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-7] ^= 1
    elif damage == "truncate":
        raw = raw[:-10]
    else:
        raw[:8] = b"XXXXXXXX"
    path.write_bytes(bytes(raw))
    assert d.load(_key(2)) is None and d.corrupt == 1
    assert not path.exists() and _key(2) not in d and list(d.gone) == [_key(2)]
    d.close()


def test_a_foreign_fingerprint_is_never_read(tmp_path):
    mine = _disk(tmp_path, fp=b"A" * 16)
    mine.submit(_key(3), torch.ones(64, dtype=torch.uint8))
    mine.flush()
    other = _disk(tmp_path, fp=b"B" * 16)
    assert _key(3) not in other and other.load(_key(3)) is None  # another directory: never opened
    # a file of fingerprint A copied under B's directory fails B's header check
    src = next(mine.dir.glob("*/*.kv"))
    dst = other.dir / src.parent.name / src.name
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(src.read_bytes())
    other.close()
    reopened = _disk(tmp_path, fp=b"B" * 16)
    assert _key(3) in reopened and reopened.load(_key(3)) is None and reopened.corrupt == 1
    mine.close()
    reopened.close()


def test_pages_at_rest_are_private_and_never_read_through_a_symlink(tmp_path):
    d = _disk(tmp_path)
    d.submit(_key(4), torch.ones(64, dtype=torch.uint8))
    d.flush()
    path = next(d.dir.glob("*/*.kv"))
    assert d.dir.stat().st_mode & 0o777 == 0o700 and path.parent.stat().st_mode & 0o777 == 0o700
    assert path.stat().st_mode & 0o777 == 0o600
    secret = tmp_path / "elsewhere"
    secret.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(secret)  # same bytes, same size: only the symlink differs
    assert d.load(_key(4)) is None and secret.exists()
    d.close()


def test_the_sweep_deletes_expired_pages_nobody_reads(tmp_path):
    d = _disk(tmp_path)
    for i in (5, 6):
        d.submit(_key(i), torch.ones(64, dtype=torch.uint8))
    d.flush()
    old = d._path(_key(5))
    os.utime(old, (time.time() - d.max_age_s - 5,) * 2)
    assert d.sweep() == 1
    assert not old.exists() and _key(5) not in d and _key(6) in d and list(d.gone) == [_key(5)]
    d.close()


def test_size_bound_evicts_oldest_files(tmp_path):
    d = _disk(tmp_path, cap=2 * (100 + 56) + 10)
    for i in range(3):
        d.submit(_key(i), torch.full((100,), i, dtype=torch.uint8))
        d.flush()
    assert _key(0) not in d and _key(1) in d and _key(2) in d and d.bytes <= d.capacity_bytes
    assert d.evictions == 1 and list(d.gone) == [_key(0)] and len(list(d.dir.glob("*/*.kv"))) == 2
    d.close()


def test_a_full_disk_stops_writes(tmp_path, monkeypatch):
    d = _disk(tmp_path)

    def no_space(path, blob):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_module, "_write_new", no_space)
    assert d.submit(_key(4), torch.ones(10, dtype=torch.uint8))
    d.flush()
    assert d.full and _key(4) not in d and not list(d.dir.glob("*/*"))
    assert not d.submit(_key(5), torch.ones(10, dtype=torch.uint8))  # refused at once, nothing queued
    d.close()


def test_a_full_queue_drops_instead_of_blocking(tmp_path, monkeypatch):
    d = _disk(tmp_path)
    d.close()  # no writer: the queue fills
    accepted = sum(d.submit(_key(i), torch.ones(4, dtype=torch.uint8)) for i in range(20))
    assert accepted == 8 and d.dropped == 12


def test_write_back_gate_keeps_unreused_pages_off_disk(tmp_path):
    from worker.kvcache.tiers.tier_store import KvTiers

    kv = _kv("int8")
    codec = PageCodec(kv)
    disk = _disk(tmp_path)
    tiers = KvTiers(codec, codec.page_bytes, disk, disk_min_hits=1)  # RAM holds one page
    k1, k2, k3 = _key(1), _key(2), _key(3)
    tiers.retain([k1, k2, k3], "24h")
    tiers.used([k1])  # k1 was matched in the prefix cache once; k2 never
    for key, page in ((k1, 0), (k2, 1), (k3, 2)):
        tiers.offload([key], [page])
    disk.flush()
    assert k1 in disk and k2 not in disk and k3 in tiers.host
    assert torch.equal(disk.load(k1), codec.read([0])[0])  # the bytes the page had when evicted
    tiers.close()


def test_files_older_than_24h_are_not_read(tmp_path):
    import os
    import time

    d = _disk(tmp_path)
    d.submit(_key(6), torch.ones(32, dtype=torch.uint8))
    d.submit(_key(7), torch.ones(32, dtype=torch.uint8))
    d.flush()
    old = time.time() - 25 * 3600
    for path in d.dir.glob("*/*.kv"):
        if path.stem == _key(6).hex():
            os.utime(path, (old, old))
    assert d.load(_key(6)) is None and _key(6) not in d and d.load(_key(7)) is not None
    d.close()
    again = _disk(tmp_path)
    assert _key(7) in again and len(again) == 1
    again.close()


def test_two_workers_on_one_directory_stay_within_its_capacity(tmp_path):
    """Each worker counts only the bytes it wrote; the sweep counts the directory, so together they are
    trimmed back to the capacity (oldest files first) instead of holding twice it."""
    cap = 4 * (100 + 56) + 10
    a, b = _disk(tmp_path, cap=cap), _disk(tmp_path, cap=cap)
    for i in range(4):
        a.submit(_key(10 + i), torch.full((100,), i, dtype=torch.uint8))
        b.submit(_key(20 + i), torch.full((100,), i, dtype=torch.uint8))
        a.flush()
        b.flush()
    assert len(list(a.dir.glob("*/*.kv"))) == 8  # 2x the capacity on disk
    assert a.sweep() == 4
    left = list(a.dir.glob("*/*.kv"))
    assert len(left) == 4 and sum(p.stat().st_size for p in left) <= cap
    a.close()
    b.close()
