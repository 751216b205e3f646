"""Where uploaded files live: `FileStore` (the interface an S3-compatible store would implement) and
`DirectoryFileStore`: a folder per tenant (named by the tenant's digest) of `<id>.jsonl` and `<id>.json`."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol


@dataclass(slots=True)
class FileObject:
    """OpenAI's file object."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: str = "file"
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True, frozen=True)
class FileLimits:
    """Per-file and per-tenant bounds (OpenAI's batch input limits: 200 MB, 50,000 requests)."""

    max_file_bytes: int = 200 << 20
    max_lines: int = 50_000
    max_files_per_tenant: int = 100
    max_tenant_bytes: int = 1 << 30


class FileStore(Protocol):
    limits: FileLimits

    def usage(self, tenant: str) -> tuple[int, int]: ...  # (files, bytes)

    def put(self, tenant: str, filename: str, purpose: str, staged: Path) -> FileObject: ...

    def get(self, tenant: str, file_id: str) -> FileObject | None: ...

    def list(self, tenant: str) -> list[FileObject]: ...

    def content_path(self, tenant: str, file_id: str) -> Path | None: ...

    def delete(self, tenant: str, file_id: str) -> bool: ...

    def staging(self, tenant: str) -> Path: ...


# an upload file this old belongs to no request: the uploads themselves are cut after minutes
STALE_UPLOAD_S = 3600


def new_file_id() -> str:
    """`file-` and 24 hex digits: the upload's microsecond (13, so ids sort by age) and 11 random ones."""
    return f"file-{time.time_ns() // 1000:013x}{secrets.token_hex(6)[:11]}"


class DirectoryFileStore:
    """Files on a local (or shared) directory, each shown once its metadata is written (atomically, last)."""

    def __init__(self, root: str | Path, limits: FileLimits | None = None) -> None:
        self.root = Path(root)
        self.limits = limits or FileLimits()

    def _dir(self, tenant: str) -> Path:
        return self.root / hashlib.sha256(tenant.encode()).hexdigest()[:32]

    def staging(self, tenant: str) -> Path:
        """A fresh path in the tenant's folder for an upload in progress (moved into place by `put`)."""
        folder = self._dir(tenant)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        stale = time.time() - STALE_UPLOAD_S  # left by a gateway that died mid-upload
        for old in folder.glob(".upload-*"):
            with contextlib.suppress(FileNotFoundError):
                if old.stat().st_mtime < stale:
                    old.unlink()
        return folder / f".upload-{secrets.token_hex(8)}"

    def put(self, tenant: str, filename: str, purpose: str, staged: Path) -> FileObject:
        obj = FileObject(new_file_id(), staged.stat().st_size, int(time.time()), filename, purpose)
        folder = self._dir(tenant)
        os.replace(staged, folder / f"{obj.id}.jsonl")
        tmp = folder / f".{obj.id}.json.tmp"
        tmp.write_text(json.dumps(obj.to_dict()))
        os.replace(tmp, folder / f"{obj.id}.json")
        return obj

    def get(self, tenant: str, file_id: str) -> FileObject | None:
        if not _valid_id(file_id):
            return None
        meta = self._dir(tenant) / f"{file_id}.json"
        try:
            return FileObject(**json.loads(meta.read_text()))
        except FileNotFoundError:
            return None

    def list(self, tenant: str) -> list[FileObject]:
        folder = self._dir(tenant)
        if not folder.is_dir():
            return []
        found = (self.get(tenant, p.stem) for p in folder.glob("file-*.json"))
        return sorted((f for f in found if f is not None), key=lambda f: f.id)  # ids sort by upload time

    def usage(self, tenant: str) -> tuple[int, int]:
        files = self.list(tenant)
        return len(files), sum(f.bytes for f in files)

    def content_path(self, tenant: str, file_id: str) -> Path | None:
        if self.get(tenant, file_id) is None:
            return None
        return self._dir(tenant) / f"{file_id}.jsonl"

    def delete(self, tenant: str, file_id: str) -> bool:
        if self.get(tenant, file_id) is None:
            return False
        folder = self._dir(tenant)
        (folder / f"{file_id}.json").unlink(missing_ok=True)  # invisible first, then the bytes
        (folder / f"{file_id}.jsonl").unlink(missing_ok=True)
        return True


def _valid_id(file_id: str) -> bool:
    """Only ids this store makes: no path can be named through one."""
    return (len(file_id) == 29 and file_id.startswith("file-")
            and all(c in "0123456789abcdef" for c in file_id[5:]))
