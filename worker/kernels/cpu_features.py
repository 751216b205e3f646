"""What this CPU's instruction set offers the kernels: read once from /proc/cpuinfo, so that modes, cutoffs
and tests follow the machine (AVX2 only, AVX-512 BF16/VNNI, AMX) instead of assuming one."""

from __future__ import annotations

import functools
from pathlib import Path

# the flags that change a default or a kernel here (printed by .ci/run beside the CPU model)
RELEVANT = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first processor's flags; empty where /proc/cpuinfo cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def has_fast_bf16() -> bool:
    """bf16 dot products (AVX-512 BF16 or AMX): bf16 matmuls beat fp32; without them `auto` is fp32."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def has_int8_dot() -> bool:
    """int8 dot-product instructions (AVX-512 VNNI, AVX-VNNI or AMX): int8 x int8 products beat bf16, and
    torch._int_mm is fast; without them it runs tens of times slower than an fp32 GEMM."""
    return bool(cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"})


def has_amx_int8() -> bool:
    """AMX int8 tiles (Intel Xeon 4th generation on): where oneDNN's int8 products beat `torch._int_mm`."""
    return "amx_int8" in cpu_flags()


def describe() -> str:
    """One line for logs and CI: the relevant flags, each present (+) or absent (-)."""
    flags = cpu_flags()
    return " ".join(("+" if f in flags else "-") + f for f in RELEVANT)


if __name__ == "__main__":
    print(describe())
