"""Arrivals at an idle engine a few milliseconds apart share its first step.

A burst of requests (a wave of clients whose previous requests ended in the same step, a batch behind one
gateway) reaches the worker spread over a few milliseconds; without a pause the first request's prefill runs
alone and the rest wait out that whole step before theirs. While the engine is idle, the loop keeps draining
the socket for as long as frames keep coming at most QUIET_MS apart, GATHER_MS in all; a lone request pays
one QUIET_MS.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import zmq

QUIET_MS = 2
GATHER_MS = int(os.environ.get("SWITCHYARD_GATHER_MS", "10"))  # 0: step at once


def gather(poller: zmq.Poller, drain: Callable[[], None]) -> None:
    """Call `drain` while frames keep arriving at most QUIET_MS apart, until GATHER_MS have passed."""
    deadline = time.monotonic() + GATHER_MS / 1000
    while (left := deadline - time.monotonic()) > 0 and poller.poll(max(1, min(QUIET_MS, int(left * 1000)))):
        drain()
