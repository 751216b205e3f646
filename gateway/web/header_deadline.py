"""uvicorn's httptools protocol with a deadline for request headers.

uvicorn bounds keep-alive idle time but not header arrival, so a slowloris client could otherwise hold a
connection forever.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class _HeaderDeadlineProtocol(HttpToolsProtocol):
    header_timeout_s = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def header_deadline_protocol(timeout_s: float) -> type[HttpToolsProtocol]:
    """The httptools protocol class with request headers due within `timeout_s` seconds."""
    return type("HeaderDeadlineProtocol", (_HeaderDeadlineProtocol,), {"header_timeout_s": timeout_s})
