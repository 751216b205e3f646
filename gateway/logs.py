"""The request id of the request being served, for log lines (a contextvar).

`RequestIdMiddleware` binds the id with `bind_request_id` at the start of each
HTTP request; asyncio copies the context into every task the request spawns,
so anything logged while serving it (routing, admission, errors) can carry the
id. `RequestIdFilter` stamps `record.request_id` from the contextvar unless the
call site already passed one with `extra={"request_id": ...}`; the process's
log handler (see `config.logs`) installs it.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar, Token

REQUEST_ID: ContextVar[str | None] = ContextVar("switchyard_request_id", default=None)


def bind_request_id(rid: str) -> Token:
    return REQUEST_ID.set(rid)


def current_request_id() -> str | None:
    return REQUEST_ID.get()


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            rid = REQUEST_ID.get()
            if rid is not None:
                record.request_id = rid
        return True
