"""The HTTP connection protocol ``serve`` runs: uvicorn's, with deadlines and a clean drain.

uvicorn bounds idle keep-alive connections only; a connection that sends part of its
request line or headers (or nothing at all) is kept forever, and on SIGTERM the requests
still receiving a body and the event streams hold shutdown until the graceful timeout,
then end with cancelled tasks and tracebacks. :func:`protocol_class` returns a subclass of
uvicorn's httptools protocol that

* writes each fixed-length response in one piece (:mod:`.held_headers`);
* answers 431 to a request whose line and headers exceed ``max_header_bytes``
  (:mod:`.head_limit`);
* closes a connection whose request headers are not complete within ``header_timeout_s``
  of the connection opening or of the previous response (the request *body* has its own
  deadline: ``api/limits.py``);
* at shutdown, answers 503 (JSON, ``Connection: close``) to requests still receiving their
  body, and calls ``on_drain`` once, which ends the SSE streams so they finish cleanly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .head_limit import HeadBudget, too_large_response
from .held_headers import HeldHeaders
from .responses import json_bytes

__all__ = ["protocol_class"]

_LINGER_S = 2.0
"""How long a connection whose head was refused (431) is read and dropped before closing."""


def _unavailable() -> bytes:
    body = json_bytes(
        {"error": "ShuttingDown", "detail": "the service is shutting down; retry elsewhere"}
    )
    return (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nretry-after: 1\r\nconnection: close\r\n\r\n%s" % (len(body), body)
    )


def protocol_class(
    header_timeout_s: float, on_drain: Callable[[], None], max_header_bytes: int = 64 * 1024
) -> type[Any]:
    """A protocol class for ``uvicorn.run(http=...)``; see the module docstring."""
    drained = False

    def drain_once() -> None:
        nonlocal drained
        if not drained:
            drained = True
            on_drain()

    class ServiceProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            cycle = self.cycle
            idle = cycle is None or cycle.response_complete
            if idle and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._head = HeadBudget(max_header_bytes)
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            if self._head.rejected:
                return  # the rest of a refused head: read and dropped until we close
            if self._head.admit(data):
                super().data_received(data)
                return
            self._cancel_header_timer()
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:  # inside another response
                self.transport.close()
                return
            self._head.rejected = True
            self.transport.write(too_large_response(max_header_bytes))
            # Closing with the client's bytes unread would reset the connection, and the
            # client could lose the 431: drop what it still sends for a moment, then close.
            self.loop.call_later(_LINGER_S, self.transport.close)

        def on_message_complete(self) -> None:
            self._head.next_request()
            super().on_message_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def on_headers_complete(self) -> None:
            self._head.head_complete()
            self._cancel_header_timer()
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is not None and cycle.transport is self.transport:
                cycle.transport = HeldHeaders(self.transport, cycle)  # type: ignore[assignment]

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()

        def shutdown(self) -> None:
            drain_once()
            cycle = self.cycle
            if (
                cycle is not None
                and not cycle.response_started
                and cycle.more_body
                and not self.transport.is_closing()
            ):
                # Still receiving its body: answer now instead of holding the shutdown.
                self.transport.write(_unavailable())
                cycle.disconnected = True  # the app's receive() now says http.disconnect
                cycle.message_event.set()
                self.transport.close()
                return
            super().shutdown()

    return ServiceProtocol
