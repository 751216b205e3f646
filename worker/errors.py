"""Errors the engine raises for a single request.

`RequestError` is the one exception type a caller of the engine needs to
handle: its `code` maps directly onto the wire protocol's `err` frame
(`bad_request`, `capacity`, `internal`), `param` names the offending field when
there is one, and `retryable` tells the gateway whether another worker (or a
later retry) might succeed.
"""

from __future__ import annotations

ERROR_CODES = frozenset({"bad_request", "capacity", "internal"})


class RequestError(Exception):
    def __init__(self, code: str, message: str, *, param: str | None = None, retryable: bool = False):
        if code not in ERROR_CODES:
            raise ValueError(f"unknown error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.retryable = retryable

    def __repr__(self) -> str:
        return f"RequestError({self.code!r}, {self.message!r}, param={self.param!r})"


def bad_request(message: str, param: str | None = None) -> RequestError:
    return RequestError("bad_request", message, param=param)
