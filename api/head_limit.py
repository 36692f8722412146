"""A bound on a request's head (request line plus headers), answered 431 when exceeded.

uvicorn's httptools parser takes headers of any size (a 16 MB header was answered 200), so
:class:`HeadBudget` counts the bytes a connection receives before each request's headers
are complete. A chunk that crosses the bound is allowed only if the blank line ending the
head lies within it, so a body that arrives in the same read as a small head is not
counted as head.
"""

from __future__ import annotations

from .responses import json_bytes

__all__ = ["HeadBudget", "too_large_response"]

_END = b"\r\n\r\n"


def too_large_response(max_bytes: int) -> bytes:
    body = json_bytes(
        {
            "error": "RequestHeaderFieldsTooLarge",
            "detail": f"the request line and headers exceed {max_bytes} bytes (max_header_bytes)",
        }
    )
    return (
        b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
    )


class HeadBudget:
    """Bytes of the current request's head so far; ``admit`` says whether a chunk fits."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.in_head = True
        self.rejected = False
        """Set once the head was refused: the connection only drains until it closes."""
        self._seen = 0
        self._tail = b""

    def admit(self, data: bytes) -> bool:
        """Count ``data`` if the head is still open; False once the head exceeds the bound."""
        if not self.in_head:
            return True
        room = self.max_bytes - self._seen
        if len(data) <= room:
            self._seen += len(data)
            self._tail = (self._tail + data)[-3:]
            return True
        # Over the bound unless the head ends within it (the rest is body or the next request).
        return _END in self._tail + data[: max(room, 0) + len(_END)]

    def head_complete(self) -> None:
        self.in_head = False

    def next_request(self) -> None:
        self.in_head = True
        self._seen = 0
        self._tail = b""
