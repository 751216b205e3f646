"""The disk tier: one checksummed file per page under a directory named by the tier fingerprint, written by a
background thread through a bounded queue (a full queue drops the write; it never blocks the engine step).

A file whose header, length or checksum is wrong, or older than `max_age_s` (24 h: OpenAI's longest prompt
cache retention), is deleted and reads as a miss (the page is recomputed); the writer thread also sweeps
expired files every `SWEEP_S`. A file of another fingerprint lives in another directory and is never opened; a
full disk stops all further writes. KV pages are an easily inverted form of prompts: directories are 0700,
files 0600, and neither a page nor its temporary file is opened through a symlink.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import stat
import struct
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from pathlib import Path

import torch
import xxhash

log = logging.getLogger(__name__)

MAGIC = b"SYKVPG02"  # 02: the fingerprint names the weights (pages.FINGERPRINT_FORMAT)
STALE_MAGICS = (b"SYKVPG01",)  # directories of these formats are deleted at start, never read
# magic, fingerprint, block digest, payload bytes, xxh3-64 of the payload
HEADER = struct.Struct("<8s16s16sQQ")
SUFFIX = ".kv"
MAX_AGE_S = 24 * 3600.0
SWEEP_S = 600.0  # how often the writer thread deletes files past max_age_s (also checked on every read)
_DIR_MODE, _FILE_MODE = 0o700, 0o600
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class DiskTier:
    """At most `capacity_bytes` of page files under `root/<fingerprint hex>/`, least recently used out
    first."""

    def __init__(self, root: str | Path, capacity_bytes: int, fingerprint: bytes, queue_pages: int = 256,
                 max_age_s: float = MAX_AGE_S) -> None:
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be > 0")
        self.dir = Path(root) / fingerprint.hex()
        self.dir.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
        os.chmod(self.dir, _DIR_MODE)  # made earlier with the umask's mode
        prune_stale_formats(Path(root))
        self._next_sweep = time.monotonic() + SWEEP_S
        self.capacity_bytes = capacity_bytes
        self.max_age_s = max_age_s
        self.fingerprint = fingerprint
        self.bytes = 0
        self.full = False  # the disk refused a write for lack of space: no more writes
        self.writes = self.dropped = self.corrupt = self.evictions = self.errors = 0
        self.gone: deque[bytes] = deque()  # keys whose files were removed (drained by the engine thread)
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._pending: dict[bytes, torch.Tensor] = {}  # queued, not yet written: readable from here
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[bytes, torch.Tensor] | None] = queue.Queue(maxsize=queue_pages)
        self._scan()
        self._thread = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._thread.start()

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index or key in self._pending

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._index)

    def submit(self, key: bytes, data: torch.Tensor) -> bool:
        """Queue a page for writing; False (dropped) when the disk is full or the queue is."""
        if self.full:
            return False
        with self._lock:
            if key in self._pending:
                return True
            self._pending[key] = data
        try:
            self._queue.put_nowait((key, data))
            return True
        except queue.Full:
            with self._lock:
                self._pending.pop(key, None)
            self.dropped += 1
            return False

    def load(self, key: bytes) -> torch.Tensor | None:
        """The page's bytes, or None when absent or bad (a bad file is deleted)."""
        with self._lock:
            queued = self._pending.get(key)
            if queued is not None:
                return queued
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        path = self._path(key)
        try:
            st = path.lstat()
            if time.time() - st.st_mtime > self.max_age_s:
                self._forget(key, delete=True)
                return None
            raw = _read_exact(path, st.st_size) if st.st_size == self._index.get(key) else b""
        except OSError:
            self._forget(key, delete=False)
            return None
        payload = self._check(raw, key)
        if payload is None:
            self.corrupt += 1
            log.warning("KV disk tier: bad page file %s (deleted; the page will be recomputed)", path.name)
            self._forget(key, delete=True)
            return None
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until every queued write is done (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5.0)

    # ------------------------------------------------------------ internals

    def _check(self, raw: bytes, key: bytes) -> bytes | None:
        if len(raw) < HEADER.size:
            return None
        magic, fp, k, size, digest = HEADER.unpack_from(raw)
        payload = raw[HEADER.size:]
        if magic != MAGIC or fp != self.fingerprint or k != key or size != len(payload):
            return None
        return payload if xxhash.xxh3_64_intdigest(payload) == digest else None

    def _path(self, key: bytes) -> Path:
        h = key.hex()
        return self.dir / h[:2] / (h + SUFFIX)

    def _scan(self) -> None:
        """Index the files a previous process left (oldest first; regular files only, made 0600); trim to the
        bound. Temporary files a killed writer left (older than a minute) go."""
        found = []
        for tmp in self.dir.glob("*/*.tmp"):
            with contextlib.suppress(OSError):
                if time.time() - tmp.lstat().st_mtime > 60:
                    tmp.unlink()
        for path, key, st in self._page_files():
            if st.st_mode & 0o077:
                with contextlib.suppress(OSError):
                    os.chmod(path, _FILE_MODE)
            if time.time() - st.st_mtime > self.max_age_s:
                path.unlink(missing_ok=True)
                continue
            found.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self.bytes += size
        with self._lock:
            self._make_room(0)

    def _write_loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, self._next_sweep - time.monotonic()))
            except queue.Empty:
                self.sweep()
                continue
            try:
                if item is None:
                    return
                if not self.full:
                    self._write(*item)
                with self._lock:
                    self._pending.pop(item[0], None)
            finally:
                self._queue.task_done()

    def _write(self, key: bytes, data: torch.Tensor) -> None:
        payload = data.numpy().tobytes()
        blob = HEADER.pack(MAGIC, self.fingerprint, key, len(payload),
                           xxhash.xxh3_64_intdigest(payload)) + payload
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return
            if len(blob) > self.capacity_bytes:
                return
            self._make_room(len(blob))
        path = self._path(key)
        # one per process: two workers may share a directory
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(mode=_DIR_MODE, exist_ok=True)
            _write_new(tmp, blob)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self.full = True
                log.warning("KV disk tier: the disk is full (%s): no further writes", exc)
            else:
                self.errors += 1
                log.warning("KV disk tier: write failed: %s", exc)
            return
        with self._lock:
            self._index[key] = len(blob)
            self.bytes += len(blob)
            self.writes += 1

    def sweep(self) -> int:
        """Delete the files older than max_age_s, then, when the directory holds more than the capacity (other
        workers write into it too), the least recently written files until it fits; returns how many went. The
        writer thread calls it every SWEEP_S (so a deleted tenant's pages are gone within max_age_s)."""
        self._next_sweep = time.monotonic() + SWEEP_S
        now, gone = time.time(), []
        files = []
        for path, key, st in self._page_files():
            if now - st.st_mtime > self.max_age_s:
                gone.append((key, path))
            else:
                files.append((st.st_mtime, st.st_size, key, path))
        total = sum(size for _, size, _, _ in files)
        for _, size, key, path in sorted(files):
            if total <= self.capacity_bytes:
                break
            gone.append((key, path))
            total -= size
        for key, path in gone:
            if key in self._index:
                self._forget(key, delete=True)
            else:  # another worker's file
                path.unlink(missing_ok=True)
        return len(gone)

    def _page_files(self) -> Iterator[tuple[Path, bytes, os.stat_result]]:
        """The directory's regular page files (symlinks and stray names skipped), with their keys and
        stats."""
        for path in self.dir.glob(f"*/*{SUFFIX}"):
            try:
                st = path.lstat()
                key = bytes.fromhex(path.stem)
            except (OSError, ValueError):
                continue
            if len(key) == 16 and stat.S_ISREG(st.st_mode):
                yield path, key, st

    def _make_room(self, size: int) -> None:
        """Under the lock: delete least recently used files until `size` more bytes fit."""
        while self._index and self.bytes + size > self.capacity_bytes:
            key, n = self._index.popitem(last=False)
            self.bytes -= n
            self.evictions += 1
            self._path(key).unlink(missing_ok=True)
            self.gone.append(key)

    def _forget(self, key: bytes, delete: bool) -> None:
        with self._lock:
            n = self._index.pop(key, None)
            if n is not None:
                self.bytes -= n
        if delete:
            self._path(key).unlink(missing_ok=True)
        self.gone.append(key)


def _write_new(path: Path, blob: bytes) -> None:
    """Write `blob` to a new 0600 file at `path` (a stale one is replaced; a symlink there is not
    followed)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, _FILE_MODE)
    with os.fdopen(fd, "wb") as f:
        f.write(blob)


def _read_exact(path: Path, size: int) -> bytes:
    """The file's bytes, never through a symlink, and only when it still holds `size` of them."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        raw = f.read(size + 1)
    return raw if len(raw) == size else b""


def prune_stale_formats(root: Path) -> int:
    """Delete the tier directories under `root` whose page files are of a format that is no longer trusted
    (their fingerprint did not name the weights); a directory of the current format (another model's) is left
    alone. Returns how many directories went."""
    pruned = 0
    for folder in root.iterdir():
        if not (folder.is_dir() and len(folder.name) == 32) or folder.is_symlink():
            continue
        pages = list(folder.glob(f"*/*{SUFFIX}"))
        try:
            with open(pages[0], "rb") as f:
                stale = bool(pages) and f.read(len(MAGIC)) in STALE_MAGICS
        except (OSError, IndexError):
            continue
        if stale:
            for page in pages:
                page.unlink(missing_ok=True)
            for sub in folder.iterdir():
                if sub.is_dir() and not any(sub.iterdir()):
                    sub.rmdir()
            if not any(folder.iterdir()):
                folder.rmdir()
            pruned += 1
            log.info("KV disk tier: deleted %d pages of a stale format under %s", len(pages), folder.name)
    return pruned
