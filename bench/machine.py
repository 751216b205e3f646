"""The CPU a benchmark ran on, for its JSON line (figures are only comparable on the same CPU), and the
line's printing."""

from __future__ import annotations

import json
import os
import platform
import sys
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


def machine_fields(load_before: tuple[float, ...]) -> dict:
    """The load average before and after the run, and the CPU count (a busy machine explains odd figures)."""
    return {"loadavg_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)], "cpus": os.cpu_count()}


def emit(result: dict, as_json: bool) -> int:
    """Print the one JSON line (stdout), and unless `as_json` an indented copy first (stderr); exit code 0."""
    if not as_json:
        print(json.dumps(result, indent=2), file=sys.stderr)
    print(json.dumps(result))
    return 0
