"""The CPU a benchmark ran on, for its JSON line (figures are only comparable on the same CPU), the line's
printing and exit code (1 when the bench's own targets are missed), and CPU pinning and accounting of the
processes a benchmark runs. A helper module: no targets of its own."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import sys
from collections.abc import Iterator
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


def add_no_targets(ap: argparse.ArgumentParser) -> None:
    """`--no-targets`: exit 0 whatever the targets say (small configurations that check the bench itself)."""
    ap.add_argument("--no-targets", action="store_true",
                    help="exit 0 even when a target is missed (small configurations check the bench)")


def targets_missed(result: dict) -> bool:
    """Whether the line's `met` (or `targets_met`) says a target was missed: a False flag, or one False value
    of a dict of them; a line with neither has no targets."""
    met = result.get("met", result.get("targets_met"))
    if isinstance(met, dict):
        return not all(met.values())
    return met is not None and not met


def exit_code(result: dict, enforce: bool = True) -> int:
    """1 when `enforce` and a target was missed (`targets_missed`), else 0: print the line first."""
    return 1 if enforce and targets_missed(result) else 0


def emit(result: dict, as_json: bool, enforce: bool = True) -> int:
    """Print the one JSON line (stdout), and unless `as_json` an indented copy first (stderr); the exit code:
    1 when `enforce` and the line's `met`/`targets_met` says a target was missed."""
    if not as_json:
        print(json.dumps(result, indent=2), file=sys.stderr)
    print(json.dumps(result))
    return exit_code(result, enforce)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def pinned(core: int) -> Iterator[None]:
    """This thread on `core` for the block: children started inside inherit the mask (as `taskset -c`)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def cores_of(pid: int) -> list[str]:
    """The distinct CPU lists of a process's threads (one entry when all are pinned alike)."""
    lists = set()
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        with contextlib.suppress(OSError):
            lists |= set(re.findall(r"^Cpus_allowed_list:\s*(\S+)$", status.read_text(), re.M))
    return sorted(lists)


def busy_cpu_s() -> float:
    """CPU seconds the whole machine spent busy so far (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s(pids: list[int]) -> float:
    """CPU seconds of the bench's processes (a gone one counts as zero)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += cpu_seconds(pid)
    return total


def serving_dtype(asked: str) -> str:
    """The dtype the workers run: `asked`, or for auto what the loader picks on this CPU."""
    if asked != "auto":
        return asked
    import torch

    from worker.model.loader import pick_dtype

    return str(pick_dtype("auto", torch.device("cpu"))).replace("torch.", "")

