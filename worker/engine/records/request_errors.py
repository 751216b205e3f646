"""The errors the engine raises for one request. `RequestError` carries a wire `ErrorCode`, so both are
defined with the protocol (`worker.protocol`) and named here for the engine's callers.
"""

from worker.protocol import ErrorCode, RequestError, bad_request

__all__ = ["ErrorCode", "RequestError", "bad_request"]
