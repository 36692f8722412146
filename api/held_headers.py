"""A response with a Content-Length leaves in one write: its head waits for its body.

uvicorn writes a response's status line and headers as soon as the app sends
``http.response.start``, and the body at ``http.response.body``: two ``send()`` system calls
and two TCP segments per response, and a client that wakes up twice. On loopback at 64-key
lookups that second write was a third of the served process's CPU. :class:`HeldHeaders` is the
transport one request cycle writes through: it holds the head of a fixed-length response and
writes it together with the first body chunk. Streamed (chunked) responses such as the event
stream and the ``100 Continue`` interim response are written at once, as before, and a cycle
that closes the connection before sending a body writes the held head first.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["HeldHeaders"]


class HeldHeaders:
    """Stands in for ``cycle.transport``; every other attribute is the real transport's."""

    __slots__ = ("_cycle", "_head", "_headed", "_transport")

    def __init__(self, transport: asyncio.Transport, cycle: Any) -> None:
        self._transport = transport
        self._cycle = cycle
        self._head: bytes | None = None
        self._headed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        head = self._head
        if head is not None:
            self._head = None
            self._transport.write(head + data)
            return
        cycle = self._cycle
        if not self._headed and cycle.response_started:
            self._headed = True  # this write is the head (the interim 100 comes before it)
            if cycle.chunked_encoding is False and not cycle.response_complete:
                self._head = bytes(data)
                return
        self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def flush(self) -> None:
        """Write a held head now (the app ended without a body)."""
        head, self._head = self._head, None
        if head is not None and not self._transport.is_closing():
            self._transport.write(head)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
