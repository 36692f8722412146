"""A served fixed-length response leaves in one write; streamed ones and ``100 Continue`` do not
wait (``api/held_headers.py``), driven through uvicorn's own request cycle."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from kvcache_offload_service.held_headers import HeldHeaders


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


def _cycle(transport: _Transport, *, expect_100: bool = False) -> RequestResponseCycle:
    scope: Any = {"type": "http", "method": "POST", "http_version": "1.1", "path": "/"}
    cycle = RequestResponseCycle(
        scope=scope, transport=transport,  # type: ignore[arg-type]
        flow=FlowControl(transport),  # type: ignore[arg-type]
        logger=logging.getLogger("test"), access_logger=logging.getLogger("test.access"),
        access_log=False, default_headers=[], message_event=asyncio.Event(),
        expect_100_continue=expect_100, keep_alive=True, on_response=lambda: None,
    )  # fmt: skip
    cycle.transport = HeldHeaders(transport, cycle)  # type: ignore[assignment]
    return cycle


def _start(length: int | None) -> dict[str, Any]:
    headers = [(b"content-type", b"application/json")]
    if length is not None:
        headers.append((b"content-length", b"%d" % length))
    return {"type": "http.response.start", "status": 200, "headers": headers}


async def test_a_fixed_length_response_is_one_write_of_head_and_body() -> None:
    transport = _Transport()
    cycle = _cycle(transport)
    await cycle.send(_start(7))
    assert transport.writes == []
    await cycle.send({"type": "http.response.body", "body": b'{"a":1}'})
    assert len(transport.writes) == 1
    head, body = transport.writes[0].split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 OK") and b"content-length: 7" in head
    assert body == b'{"a":1}'


async def test_a_streamed_response_writes_its_head_at_once() -> None:
    transport = _Transport()
    cycle = _cycle(transport)
    await cycle.send(_start(None))  # chunked, like the event stream
    assert len(transport.writes) == 1 and transport.writes[0].startswith(b"HTTP/1.1 200 OK")
    await cycle.send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
    assert len(transport.writes) == 2


async def test_a_fixed_length_body_in_pieces_sends_the_head_with_the_first() -> None:
    transport = _Transport()
    cycle = _cycle(transport)
    await cycle.send(_start(6))
    await cycle.send({"type": "http.response.body", "body": b"abc", "more_body": True})
    await cycle.send({"type": "http.response.body", "body": b"def"})
    assert len(transport.writes) == 2
    assert transport.writes[0].endswith(b"\r\n\r\nabc") and transport.writes[1] == b"def"


async def test_the_interim_100_continue_is_not_held() -> None:
    transport = _Transport()
    cycle = _cycle(transport, expect_100=True)
    cycle.more_body = False
    cycle.message_event.set()
    await cycle.receive()
    assert transport.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    await cycle.send(_start(2))
    await cycle.send({"type": "http.response.body", "body": b"ok"})
    assert len(transport.writes) == 2 and transport.writes[1].endswith(b"\r\n\r\nok")


async def test_closing_before_the_body_writes_the_held_head_first() -> None:
    transport = _Transport()
    cycle = _cycle(transport)
    await cycle.send(_start(10))
    cycle.transport.close()  # what uvicorn does when the app fails after starting
    assert len(transport.writes) == 1 and transport.writes[0].startswith(b"HTTP/1.1 200 OK")
    assert transport.closed
