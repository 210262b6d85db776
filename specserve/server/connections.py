"""HTTP/1.1 connections with deadlines on each request's head and body, and a cap on each
client's open connections.

uvicorn waits as long as a client likes for a request line and its headers, and for the body
they announce: a client that opens connections and sends nothing, half a header, or a header
and then a body a few bytes at a time, holds a socket and a file descriptor each (and, while
its body is awaited, a task) until it leaves, and enough of them leave none for anyone else.
Here a request's head must arrive within `head_timeout` seconds of the connection opening, or
of the request's first bytes on a connection kept alive, and its whole body within
`body_timeout` seconds of its head; else the connection is closed (a handler awaiting the body
sees the client disconnect). Streamed responses and connections idle between requests
(uvicorn's keep-alive timeout) are not timed by it.

Deadlines bound how long a connection may stay idle, not how many one client opens: a client
(one IP address) may hold at most `max_per_client` connections at once. The next one is
answered at once with HTTP 429 and an OpenAI-style error body, and closed, while every other
client's connections are served as before. Behind a proxy every connection comes from the
proxy's address: size the cap for it (or turn it off) there.
"""

from __future__ import annotations

import asyncio
import json
import resource

from uvicorn.protocols.http.h11_impl import H11Protocol

from specserve.server.openai_serving import APIError


def default_max_per_client() -> int:
    """A quarter of the process's open-file limit (at least 16): one client cannot take the
    descriptors every other client's connections need."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(16, (soft if soft != resource.RLIM_INFINITY else 1 << 20) // 4)


class DeadlineProtocol(H11Protocol):
    head_timeout = 60.0
    body_timeout = 60.0
    max_per_client = 0  # 0: no cap
    open_per_client: dict[str, int] = {}  # client address -> its open connections (per class)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        peer = transport.get_extra_info("peername")
        self._client = peer[0] if self.max_per_client and isinstance(peer, tuple) else None
        if self._client is not None:
            count = self.open_per_client.get(self._client, 0)
            if count >= self.max_per_client:
                self._client = None  # (not counted)
                self._refuse(transport)
                return
            self.open_per_client[self._client] = count + 1
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
        if self._client is not None:
            left = self.open_per_client[self._client] - 1
            if left:
                self.open_per_client[self._client] = left
            else:
                del self.open_per_client[self._client]
            self._client = None
        super().connection_lost(exc)

    def _refuse(self, transport: asyncio.Transport) -> None:
        body = json.dumps(APIError(
            429, f"this client already has {self.max_per_client} open connections to the server "
                 "(--max-connections-per-client); reuse or close one",
            type="rate_limit_error", code="too_many_connections").body()).encode()
        transport.write(b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
                        b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        transport.close()

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


def http_protocol(head_seconds: float, body_seconds: float, max_per_client: int) -> type[DeadlineProtocol]:
    """The protocol class for uvicorn's `http=` with these deadlines and this cap (0: none),
    counting its own connections."""
    return type("DeadlineProtocol", (DeadlineProtocol,),
                {"head_timeout": head_seconds, "body_timeout": body_seconds,
                 "max_per_client": max_per_client, "open_per_client": {}})
