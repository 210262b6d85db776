"""HTTP/1.1 connections with deadlines on each request's head and body.

uvicorn waits as long as a client likes for a request line and its headers, and for the body
they announce: a client that opens connections and sends nothing, half a header, or a header
and then a body a few bytes at a time, holds a socket and a file descriptor each (and, while
its body is awaited, a task) until it leaves, and enough of them leave none for anyone else.
Here a request's head must arrive within `head_timeout` seconds of the connection opening, or
of the request's first bytes on a connection kept alive, and its whole body within
`body_timeout` seconds of its head; else the connection is closed (a handler awaiting the body
sees the client disconnect). Streamed responses and connections idle between requests
(uvicorn's keep-alive timeout) are not timed by it.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class DeadlineProtocol(H11Protocol):
    head_timeout = 60.0
    body_timeout = 60.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._arm_head()

    def data_received(self, data: bytes) -> None:
        if self._timer is None and self.cycle is not None and self.cycle.response_complete:
            self._arm_head()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self._timer is None:
            return
        if self._awaiting_body:
            if not self._cycle.more_body:  # the whole body arrived
                self._disarm()
        elif self.cycle is not self._cycle:  # a whole head arrived
            self._disarm()
            if self.cycle.more_body:
                self._arm(self.body_timeout, self.cycle, body=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm_head(self) -> None:
        self._arm(self.head_timeout, self.cycle, body=False)  # the cycle before the awaited head

    def _arm(self, seconds: float, cycle: object, body: bool) -> None:
        self._cycle, self._awaiting_body = cycle, body
        self._timer = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        late = self._cycle.more_body if self._awaiting_body else self.cycle is self._cycle
        if late and not self.transport.is_closing():
            self.transport.close()


def with_deadlines(head_seconds: float, body_seconds: float) -> type[DeadlineProtocol]:
    """The protocol class for uvicorn's `http=` with these deadlines."""
    return type("DeadlineProtocol", (DeadlineProtocol,),
                {"head_timeout": head_seconds, "body_timeout": body_seconds})
