"""The id of the request being served, in a contextvar: every log line written while serving it carries it."""

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
