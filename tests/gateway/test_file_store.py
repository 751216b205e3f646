"""The directory file store: tenant folders apart, ids that name no path, a file visible only once whole."""

from __future__ import annotations

from gateway.files.file_store import DirectoryFileStore


def _staged(store: DirectoryFileStore, tenant: str, data: bytes):
    path = store.staging(tenant)
    path.write_bytes(data)
    return path


def test_put_get_list_delete_per_tenant(tmp_path):
    store = DirectoryFileStore(tmp_path)
    a = store.put("acme", "x.jsonl", "batch", _staged(store, "acme", b'{"a":1}\n'))
    b = store.put("acme", "y.jsonl", "batch", _staged(store, "acme", b'{"b":2}\n{"c":3}\n'))
    assert store.get("acme", a.id) == a and store.content_path("acme", b.id).read_bytes().count(b"\n") == 2
    assert [f.id for f in store.list("acme")] == [a.id, b.id]  # in upload order
    assert store.usage("acme") == (2, a.bytes + b.bytes)
    assert store.get("other", a.id) is None and store.content_path("other", a.id) is None
    assert not store.delete("other", a.id) and store.get("acme", a.id) is not None
    assert store.delete("acme", a.id) and store.get("acme", a.id) is None
    assert not list(tmp_path.glob(f"*/{a.id}*"))  # metadata and bytes gone
    assert "acme" not in {p.name for p in tmp_path.iterdir()}  # folders are named by a digest


def test_ids_that_are_not_the_stores_name_no_file(tmp_path):
    store = DirectoryFileStore(tmp_path)
    f = store.put("acme", "x.jsonl", "batch", _staged(store, "acme", b"{}\n"))
    for bad in ("../" + f.id, f.id + "/..", "file-" + "0" * 23 + "/", f.id.upper(), ""):
        assert store.get("acme", bad) is None and store.content_path("acme", bad) is None
        assert not store.delete("acme", bad)
    assert store.get("acme", f.id) is not None


def test_a_staged_upload_is_not_listed(tmp_path):
    store = DirectoryFileStore(tmp_path)
    _staged(store, "acme", b"half")
    assert store.list("acme") == [] and store.usage("acme") == (0, 0)


def test_uploads_left_by_a_dead_gateway_are_swept(tmp_path):
    import os

    store = DirectoryFileStore(tmp_path)
    left = _staged(store, "acme", b"half")
    os.utime(left, (0, 0))
    fresh = store.staging("acme")
    assert not left.exists() and fresh.parent == left.parent
