"""On-disk caches of what a load measures: W8A8 calibration (each linear's input maxima over the calibration
text, keyed by a digest of the model's weights, their dtype, the calibration tokens, the CPU and torch) and
the timed kernel choices (`worker.quant.calibrate`), so that a restarted worker neither prefills nor times
them again.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import xxhash
from torch import nn

from worker.kernels.cpu import build_name
from worker.text.model_source import cache_base, prune_oldest

log = logging.getLogger(__name__)

CACHE_FORMAT = 1
# files of each kind kept (maxima per model and dtype, choices per CPU and build); oldest go first
MAX_FILES = 16
Maxima = dict[tuple[int, str], torch.Tensor]


def cache_dir() -> Path:
    return cache_base() / "calibration"


def cpu_id() -> str:
    """The CPU model and instruction flags: kernels round differently on AVX2 and AVX-512."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    flags = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("flags")), "")
    return f"{model}|{flags}"


def model_key(model: nn.Module, ids: list[int]) -> str:
    """A digest of every parameter's bytes (xxh3: tens of ms for the default model), dtypes, the token ids,
    the CPU and torch's version."""
    h = xxhash.xxh3_128()
    h.update(f"v{CACHE_FORMAT}|{torch.__version__}|{cpu_id()}".encode())
    for name, p in model.state_dict().items():
        h.update(f"{name}:{p.dtype}:{tuple(p.shape)}".encode())
        h.update(p.detach().contiguous().cpu().view(torch.uint8).numpy().data)
    h.update(np.asarray(ids, dtype=np.int32).tobytes())
    return h.hexdigest()


def cached_maxima(model: nn.Module, ids: list[int], measure: Callable[[], Maxima]) -> Maxima:
    """The maxima from the cache when a valid entry exists, else `measure()` (stored for the next start).
    A missing, corrupt or mismatched file is measured again; a cache that cannot be written is only logged."""
    key = model_key(model, ids)
    path = cache_dir() / f"act-max-{key}.pt"
    got = _load(path, model)
    if got is not None:
        log.info("W8A8 calibration from the cache (%s)", path.name)
        return got
    maxima = measure()
    _store(path, maxima)
    return maxima


def _load(path: Path, model: nn.Module) -> Maxima | None:
    try:
        raw = torch.load(path, weights_only=True)
        maxima = {(int(i), str(name)): t for (i, name), t in raw.items()}
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - any unreadable entry is measured again
        log.warning("ignoring calibration cache %s: %s", path.name, exc)
        return None
    for (i, name), t in maxima.items():
        layer = model.layers[i] if 0 <= i < len(model.layers) else None
        lin = getattr(layer, name, None) if layer is not None else None
        if lin is None or t.shape != (lin.weight.shape[1],) or not torch.isfinite(t).all():
            log.warning("ignoring calibration cache %s: it does not fit the model", path.name)
            return None
    return maxima


def _store(path: Path, maxima: Maxima) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
            torch.save({k: v.contiguous() for k, v in maxima.items()}, f)
        os.replace(f.name, path)
        prune_oldest(path.parent, "act-max-*.pt", MAX_FILES)
    except OSError as exc:
        log.warning("could not write the calibration cache: %s", exc)


# ---------------------------------------------------------------- kernel choices (`worker.quant.calibrate`)

CHOICES_FORMAT = 1
# set (non-empty): time every kernel choice again and store the new ones
RECALIBRATE_ENV = "SWITCHYARD_RECALIBRATE"


def choices_path() -> Path:
    """This machine's file of kernel choices: named by a digest of the CPU, torch, the C++ kernels' build
    (their sources and flags) and torch's thread count, every one of which moves the timings."""
    key = f"c{CHOICES_FORMAT}|{torch.__version__}|{build_name()}|{torch.get_num_threads()}|{cpu_id()}"
    return cache_dir() / f"kernel-choices-{xxhash.xxh3_64_hexdigest(key.encode())}.json"


def load_choices() -> dict[str, int]:
    """The stored choices (key -> integer), empty where there are none, the file is unreadable or malformed,
    or `SWITCHYARD_RECALIBRATE` asks for new measurements."""
    if os.environ.get(RECALIBRATE_ENV):
        return {}
    path = choices_path()
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("ignoring kernel choices %s: %s", path.name, exc)
        return {}
    if not isinstance(raw, dict) or not all(isinstance(k, str) and type(v) is int for k, v in raw.items()):
        log.warning("ignoring kernel choices %s: not a map of names to integers", path.name)
        return {}
    log.info("kernel choices from the cache (%s, %d entries)", path.name, len(raw))
    return raw


def store_choices(choices: dict[str, int]) -> None:
    """Write `choices` whole (atomically); a cache that cannot be written is only logged."""
    path = choices_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(choices, f, sort_keys=True)
        os.replace(f.name, path)
        prune_oldest(path.parent, "kernel-choices-*.json", MAX_FILES)
    except OSError as exc:
        log.warning("could not write the kernel choices: %s", exc)
