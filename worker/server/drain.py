"""Lame-duck state of a worker: SIGTERM (or SIGINT) starts a drain with a deadline.

The signal handler only flips a flag; the server loop polls it and refuses new requests while draining.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

log = logging.getLogger(__name__)

DRAINING_MESSAGE = "worker is draining (shutting down); retry on another worker"
DRAIN_EXPIRED_MESSAGE = "worker shut down before the request finished (drain timeout); retry"


class Drain:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.deadline: float | None = None  # time.monotonic() when draining

    @property
    def active(self) -> bool:
        return self.deadline is not None

    def start(self) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + self.timeout
            log.info("drain started: finishing running requests within %.1fs", self.timeout)

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT start the drain (main thread only)."""
        def handler(signum: int, _frame: FrameType | None) -> None:
            self.start()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
