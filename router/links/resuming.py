"""When a stream that already produced tokens may carry on on another worker, and what that worker is sent."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from router.links.client import LinkError, WorkerError
from worker.protocol import ErrorCode


def resume_reason(err: WorkerError) -> str | None:
    """Why a stream that already produced tokens may carry on elsewhere (None: it may not)."""
    if err.code == LinkError.WORKER_LOST:
        return "worker_lost"
    if err.code == ErrorCode.DRAINING:
        return "drain"
    if err.code == ErrorCode.ABANDONED:
        return "abandoned"
    if err.code in (LinkError.CLOSED, LinkError.PROTOCOL) and err.retryable:
        return "link"
    return None


def with_streamed(tokens: Sequence[int] | np.ndarray | bytes, streamed: list[int]) -> np.ndarray:
    """The request's tokens followed by those already streamed (int32, as the wire packs them)."""
    head = (np.frombuffer(tokens, dtype="<i4") if isinstance(tokens, bytes)
            else np.asarray(tokens, dtype="<i4"))
    return np.concatenate([head, np.asarray(streamed, dtype="<i4")])
