"""The CPU a benchmark ran on, for its JSON line (figures are only comparable on the same CPU)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """/proc/cpuinfo's model name, else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"
