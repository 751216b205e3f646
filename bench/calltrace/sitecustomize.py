"""Loaded only by `bench/request_path.py`'s child processes (through PYTHONPATH): between SIGUSR1 and
SIGUSR2 the main thread records which Switchyard modules run code, then writes their names to
`$SWITCHYARD_CALLTRACE.<pid>`."""

import os
import signal
import sys

_OUT = os.environ.get("SWITCHYARD_CALLTRACE")
_PACKAGES = {"common", "worker", "tenancy", "admission", "router", "gateway", "config"}
_seen: set[str] = set()


def _profile(frame, event, _arg):
    if event == "call":
        name = frame.f_globals.get("__name__", "")
        if name.partition(".")[0] in _PACKAGES:
            _seen.add(name)


def _start(_signum, _frame):
    _seen.clear()
    sys.setprofile(_profile)


def _stop(_signum, _frame):
    sys.setprofile(None)
    with open(f"{_OUT}.{os.getpid()}", "w") as out:
        out.write("\n".join(sorted(_seen)))


if _OUT:
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
