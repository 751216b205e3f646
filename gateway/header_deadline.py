"""A deadline for request headers: uvicorn's httptools protocol, closing connections whose headers dawdle.

uvicorn bounds the idle time between keep-alive requests (`timeout_keep_alive`)
but not the time a client takes to send a request's headers, so a slowloris
client trickling header bytes holds a connection forever. `header_deadline_protocol(s)`
returns the httptools protocol class with one timer per connection: armed when
the connection opens and when a request's first byte arrives, cancelled once its
headers are complete; if it fires, the connection is closed. The body has its own
deadline in `gateway.http.read_json` (408), so a whole request is bounded.
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
