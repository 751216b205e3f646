"""A GGUF file's scalar metadata and tensor table, cached on disk by the file's digest.

gguf-py's reader parses every field, the tokenizer's ~100k strings among them (about 5 s of a worker's start
on AMD Zen 3); a start with the table cached maps the tensors at their offsets instead.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from worker.text.model_source import cache_base, file_digest, prune_oldest

log = logging.getLogger(__name__)
INDEX_FORMAT = 1
MAX_FILES = 16  # indexes kept (one per model file); the oldest go first
_BIG_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
               "tokenizer.ggml.scores")


@dataclass(slots=True)
class GGUFTensor:
    name: str
    qtype: int  # gguf.GGMLQuantizationType
    offset: int  # of its data from the file's start
    dtype: str  # numpy dtype of the raw data: what gguf.quants.dequantize takes
    shape: list[int]  # of the raw data (bytes per row for block-quantized types)


@dataclass(slots=True)
class GGUFIndex:
    meta: dict
    tensors: list[GGUFTensor]

    def arrays(self, path: Path) -> list[tuple[GGUFTensor, np.ndarray]]:
        """Each tensor's raw data, read-only views of one map of the file."""
        mm = np.memmap(path, mode="r")
        return [(t, np.frombuffer(mm, np.dtype(t.dtype), int(np.prod(t.shape)), t.offset).reshape(t.shape))
                for t in self.tensors]


def index_path(path: Path) -> Path:
    return cache_base() / "gguf" / f"{file_digest(path)[:32]}-v{INDEX_FORMAT}.json"


def read_index(path: Path) -> GGUFIndex:
    """The cached index of `path`, or the reader's (then cached; a cache that cannot be written is
    skipped)."""
    cached = index_path(path)
    try:
        raw = json.loads(cached.read_text())
        return GGUFIndex(raw["meta"], [GGUFTensor(**t) for t in raw["tensors"]])
    except OSError:  # not cached yet, or no cache folder to read
        pass
    except (ValueError, KeyError, TypeError) as exc:  # torn or from another layout: parse the file again
        log.warning("ignoring a bad GGUF index %s: %s", cached, exc)
    index = _parse(path)
    _write(cached, index)
    return index


def _parse(path: Path) -> GGUFIndex:
    import gguf

    reader = gguf.GGUFReader(str(path))
    tensors = [GGUFTensor(t.name, int(t.tensor_type), int(t.data_offset), t.data.dtype.str,
                          list(t.data.shape))
               for t in reader.tensors]
    return GGUFIndex(scalar_metadata(reader), tensors)


def scalar_metadata(reader: Any) -> dict:
    """A `gguf.GGUFReader`'s fields but the tokenizer's large arrays, as Python values."""
    meta: dict = {}
    for key, fld in reader.fields.items():
        if key in _BIG_ARRAYS:
            continue
        try:
            meta[key] = fld.contents()
        except Exception:  # noqa: BLE001 - exotic field types are not needed
            continue
    return meta


def _write(cached: Path, index: GGUFIndex) -> None:
    tmp = cached.with_suffix(f".tmp-{os.getpid()}")
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"meta": index.meta, "tensors": [asdict(t) for t in index.tensors]}))
        tmp.replace(cached)
        prune_oldest(cached.parent, "*.json", MAX_FILES)
    except (OSError, TypeError, ValueError) as exc:  # read-only cache, or metadata JSON cannot hold
        log.warning("GGUF index not cached (%s): %s", cached, exc)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
