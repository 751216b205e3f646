"""Optional C++ kernels for CPU (`csrc/`), compiled once by `make install` or on first use; None without a
compiler.

Paged decode attention reads K/V straight from the pages where the torch path gathers a padded copy; paged
prefill attention does a step's prompt chunks in one call, 2-3x faster than torch's SDPA on them; the race
sampler draws a token per row in one pass where the torch path makes [rows, vocab] temporaries; the fused ops
(`worker.kernels.layer_ops`) do a layer's norms, SiLU-mul and RoPE in one pass each; the int8 KV kernels
(`kv_int8.cpp`) write and read 8-bit pages.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from worker.text.model_source import cache_base, prune_oldest

log = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
# Three compilation units, built in parallel by ninja: the attention kernels (the longest), the other kernels
# and the Python bindings; one file under torch/extension.h builds slower than the three in parallel.
_UNITS = ("unit_attention.cpp", "unit_ops.cpp", "bindings.cpp")
_SRC = "\n".join(p.name + "\n" + p.read_text() for p in sorted(_CSRC.iterdir()) if p.suffix in (".h", ".cpp"))

_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
# Named by the source and flags: checkouts with different kernel versions never rebuild each other's
# copy in the shared torch extensions folder.
_NAME = "switchyard_cpu_" + hashlib.sha256((_SRC + " ".join(_CFLAGS)).encode()).hexdigest()[:12]
MAX_RECORDS = 16  # library paths kept (one per build: each kernel source change is a new one)
STALE_LOCK_S = 600.0  # the longest wait for another live build of the kernels

_module: object | None = None
_tried = False


@contextlib.contextmanager
def _build_turn(name: str) -> Iterator[None]:
    """Hold this kernel's builder lock (a `flock`, released by the kernel when its holder dies) while
    building.

    torch waits on its own lock file without a deadline, and a compile killed mid-way leaves that file behind.
    Every build here goes through this lock, so once we hold it a torch lock file is stale and removed at once
    (it used to wait STALE_LOCK_S). Another live builder is waited for up to STALE_LOCK_S, then built past."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        build = Path(_get_build_directory(name, verbose=False))
    except Exception:  # noqa: BLE001 - a private helper; without it, torch's own wait applies
        yield
        return
    fd = os.open(build.parent / f"{name}.builder", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        deadline = time.monotonic() + STALE_LOCK_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    log.warning("another kernel build held its lock for %.0fs; building anyway", STALE_LOCK_S)
                    break
                time.sleep(0.5)
        lock = build / "lock"
        if lock.exists():
            log.warning("removing a kernel build lock left by a killed build: %s", lock)
            lock.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the flock


def _load_built(name: str):
    """The module `name` if it is already built in torch's extensions folder, imported without torch's build
    lock or a ninja run; else None. Its name hashes the sources and flags, so a library under it is this code.
    Every load through torch takes the lock, even with nothing to build, so a worker killed at that moment
    left it behind and every later worker waited (up to STALE_LOCK_S) for nothing."""
    try:
        from torch.utils.cpp_extension import LIB_EXT, _get_build_directory, _import_module_from_library

        build = _get_build_directory(name, verbose=False)
        if not (Path(build) / f"{name}{LIB_EXT}").is_file():
            return None
        return _import_module_from_library(name, build, True)
    except Exception:  # noqa: BLE001 - private helpers, or a library torn by a killed link: build as before
        return None


def _record_path(name: str) -> Path:
    return cache_base() / "kernels" / f"{name}.path"


def _load_recorded(name: str):
    """The module at the library path an earlier load of `name` recorded, imported without torch's
    cpp_extension (importing it, and setuptools with it, took 0.3 s of every worker start); None without a
    usable record."""
    try:
        lib = Path(_record_path(name).read_text().strip())
        if not lib.name.startswith(name + ".") or not lib.is_file():
            return None
        spec = importlib.util.spec_from_file_location(name, lib)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception:  # noqa: BLE001 - no record, or a library gone or torn: torch's own lookup decides
        return None


def _record(name: str, module) -> None:
    """Keep the loaded library's path for the next process (at most MAX_RECORDS names are kept)."""
    try:
        path = _record_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(str(module.__file__))
        os.replace(tmp, path)
        prune_oldest(path.parent, "*.path", MAX_RECORDS)
    except OSError as exc:
        log.info("kernel library path not recorded: %s", exc)


def build_name() -> str:
    """The extension's name: a digest of its sources and compiler flags (what timings of its kernels depend
    on)."""
    return _NAME


def extension():
    """The compiled extension module, or None if unavailable (built at most once per process)."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("SWITCHYARD_NO_CPU_KERNELS"):
        return None
    _module = _load_recorded(_NAME)
    if _module is not None:
        return _module
    try:
        from torch.utils.cpp_extension import load

        _module = _load_built(_NAME)
        if _module is None:
            with _build_turn(_NAME):  # another process may have built it while we waited: load that
                _module = _load_built(_NAME) or load(
                    name=_NAME, sources=[str(_CSRC / unit) for unit in _UNITS], extra_cflags=_CFLAGS,
                    extra_ldflags=["-fopenmp"], extra_include_paths=[str(_CSRC)], verbose=False)
        _record(_NAME, _module)
    except Exception as exc:  # noqa: BLE001 - no compiler / headers: fall back to pure torch
        log.warning("CPU kernels unavailable, using the torch paths: %s", exc)
        _module = None
    return _module


def paged_decode_kernel():
    """The compiled `paged_decode(q, kc, vc, tables, lens, block_size, scale)`, or None if unavailable."""
    mod = extension()
    return mod.paged_decode if mod is not None else None


def paged_kv_write_kernel():
    """The compiled `paged_kv_write(k, v, kc, vc, slot_mapping)`, or None if unavailable."""
    mod = extension()
    return mod.paged_kv_write if mod is not None else None


def paged_prefill_kernel(num_heads: int, num_kv_heads: int, head_dim: int):
    """The compiled `paged_prefill(q, kc, vc, tables, q_lens, ctx_lens, block_size, scale)` where it handles
    the shape (head size 64 or 128; query groups whose whole tokens fill 4, 6 or 8 rows), else None."""
    mod = extension()
    group = num_heads // num_kv_heads
    rows = (8 // group) * group
    if mod is None or head_dim not in (64, 128) or rows not in (4, 6, 8):
        return None
    return mod.paged_prefill


def int8_kv_kernels(num_heads: int, num_kv_heads: int, head_dim: int):
    """(paged_decode_int8, paged_prefill_int8 or None where `paged_prefill_kernel` is, paged_kv_write_int8):
    the kernels over 8-bit KV pages (`csrc/kv_int8.cpp`), or None if unavailable."""
    mod = extension()
    if mod is None:
        return None
    prefill = mod.paged_prefill_int8 if paged_prefill_kernel(num_heads, num_kv_heads, head_dim) else None
    return mod.paged_decode_int8, prefill, mod.paged_kv_write_int8


def race_sample_kernel():
    """The compiled `race_sample(probs, seed, step, seed_hi) -> tokens`, or None if unavailable."""
    mod = extension()
    return mod.race_sample if mod is not None else None


def available() -> bool:
    return extension() is not None and torch.backends.openmp.is_available()


if __name__ == "__main__":
    # `make install` builds the kernels once, so no worker pays the compile on its first request, and fails
    # when they do not build (a silent fallback would serve every request on the slow torch paths)
    import sys

    ready = available()
    print("CPU kernels (paged decode and prefill attention, race sampler, fused ops):",
          "ready" if ready
          else "FAILED to build (see the log above); SWITCHYARD_ALLOW_NO_KERNELS=1 accepts the torch "
          "paths")
    sys.exit(0 if ready or os.environ.get("SWITCHYARD_ALLOW_NO_KERNELS") == "1" else 1)
