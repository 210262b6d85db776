"""HTTP/1.1 connections with a deadline on each request's head.

uvicorn waits as long as a client likes for a request line and its headers: a client that
opens connections and sends nothing, or half a header, holds a socket and a file descriptor
each until it leaves, and enough of them leave none for anyone else. Here a request's head
must arrive within `head_timeout` seconds of the connection opening, or of the request's first
bytes on a connection kept alive; else the connection is closed. Bodies, streamed responses
and connections idle between requests (uvicorn's keep-alive timeout) are not timed by it.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class HeadDeadlineProtocol(H11Protocol):
    head_timeout = 60.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self.cycle is not None and self.cycle.response_complete:
            self._arm()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self._head_timer is not None and self.cycle is not self._head_of:  # a whole head arrived
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._head_of = self.cycle  # the cycle before the request whose head is awaited
        self._head_timer = self.loop.call_later(self.head_timeout, self._expired)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _expired(self) -> None:
        self._head_timer = None
        if self.cycle is self._head_of and not self.transport.is_closing():
            self.transport.close()


def with_head_timeout(seconds: float) -> type[HeadDeadlineProtocol]:
    """The protocol class for uvicorn's `http=` with this deadline."""
    return type("HeadDeadlineProtocol", (HeadDeadlineProtocol,), {"head_timeout": seconds})
