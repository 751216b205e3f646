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
HANDOFF_MESSAGE = "worker is draining: the stream carries on on another worker"


class Drain:
    """`handoff_after`: seconds into a drain at which running streams are handed over (an `err` with code
    `draining`; the gateway resumes each on another worker); None
    keeps them here until they end or time out."""

    def __init__(self, timeout: float, handoff_after: float | None = None) -> None:
        self.timeout = timeout
        self.handoff_after = handoff_after
        self.deadline: float | None = None  # time.monotonic() when draining
        self.started: float | None = None

    @property
    def active(self) -> bool:
        return self.deadline is not None

    def start(self) -> None:
        if self.deadline is None:
            self.started = time.monotonic()
            self.deadline = self.started + self.timeout
            log.info("drain started: finishing running requests within %.1fs", self.timeout)

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def handoff_due(self, now: float) -> bool:
        return (self.started is not None and self.handoff_after is not None
                and now >= self.started + self.handoff_after)

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT start the drain (main thread only)."""
        def handler(signum: int, _frame: FrameType | None) -> None:
            self.start()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
