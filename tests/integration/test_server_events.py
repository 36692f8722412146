"""The SSE feed of a real server: order, filters, resume, gaps, reconnects, lease expiry."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import anyio
import httpx
import pytest

from kvcache_offload.aio import EngineEvent, EventType, GapMarker
from kvcache_offload.client import OffloadClient
from kvcache_offload.contracts.offload_key import OffloadKey
from tests.integration._server import Server, running_server


def key(i: int) -> OffloadKey:
    return OffloadKey(i.to_bytes(8, "big") + b"\0\0\0\0")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    env = {"KVCACHE_OFFLOAD_EVENT_BUFFER_SIZE": "64", "KVCACHE_OFFLOAD_SSE_HEARTBEAT_S": "0.2"}
    with running_server(env=env) as srv:
        yield srv


@pytest.fixture
async def client(server: Server) -> AsyncIterator[OffloadClient]:
    async with OffloadClient(server.url) as c:
        await c.reset()
        yield c


async def store_keys(client: OffloadClient, keys: list[OffloadKey]) -> None:
    for k in keys:
        lease = await client.prepare_store([k])
        await client.complete_store(lease.lease_id)


async def last_seq(client: OffloadClient) -> int:
    return int((await client.stats())["last_event_seq"])


async def wait_subscribers(client: OffloadClient, count: int) -> None:
    with anyio.fail_after(10):
        while (await client.stats())["event_subscribers"] < count:
            await anyio.sleep(0.01)


async def collect(
    stream: AsyncIterator[EngineEvent | GapMarker], count: int
) -> list[EngineEvent | GapMarker]:
    items: list[EngineEvent | GapMarker] = []
    with anyio.fail_after(10):
        async for item in stream:
            items.append(item)
            if len(items) == count:
                break
    return items


async def test_live_events_arrive_in_sequence_order(client: OffloadClient) -> None:
    start = await last_seq(client)
    async with OffloadClient(client._http.base_url.__str__()) as listener:
        stream = listener.events(types=["stored"])
        got: list[EngineEvent | GapMarker] = []

        async def listen() -> None:
            got.extend(await collect(stream, 5))

        async with anyio.create_task_group() as tg:
            tg.start_soon(listen)
            await wait_subscribers(client, 1)
            await store_keys(client, [key(i) for i in range(5)])
        await stream.aclose()
    assert all(isinstance(e, EngineEvent) and e.type is EventType.STORED for e in got)
    seqs = [e.seq for e in got if isinstance(e, EngineEvent)]
    assert seqs == sorted(seqs) and seqs[0] > start
    assert [e.keys for e in got if isinstance(e, EngineEvent)] == [[key(i)] for i in range(5)]


async def test_resume_from_last_event_id_replays_exactly_the_newer_events(
    client: OffloadClient,
) -> None:
    start = await last_seq(client)
    await store_keys(client, [key(i) for i in range(6)])
    stream = client.events(last_event_id=start + 2, reconnect=False)
    items = await collect(stream, 4)
    await stream.aclose()
    assert [e.seq for e in items if isinstance(e, EngineEvent)] == list(range(start + 3, start + 7))


async def test_resume_older_than_the_ring_starts_with_a_gap_event(client: OffloadClient) -> None:
    start = await last_seq(client)
    await store_keys(client, [key(i) for i in range(150)])  # rings keep 64 (up to 128)
    stream = client.events(last_event_id=start, reconnect=False)
    items = await collect(stream, 2)
    await stream.aclose()
    gap, first = items
    assert isinstance(gap, GapMarker) and gap.next_seq > start + 1
    assert gap.next_seq - gap.missed - 1 == start  # the gap covers exactly the lost events
    assert isinstance(first, EngineEvent) and first.seq == gap.next_seq


class _DropOnce(httpx.AsyncBaseTransport):
    """Cuts the first event stream in the middle, as a flaky network would."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.resume_headers: list[str | None] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path != "/v1/events":
            return response
        self.resume_headers.append(request.headers.get("last-event-id"))
        if len(self.resume_headers) > 1:
            return response
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_Truncated(response.stream),  # type: ignore[arg-type]
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Truncated(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream) -> None:
        self.inner = inner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.inner:
            yield chunk[: len(chunk) // 2]
            break
        raise httpx.ReadError("connection dropped by the test")

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_client_reconnects_with_last_event_id_and_loses_nothing(
    server: Server, client: OffloadClient
) -> None:
    start = await last_seq(client)
    await store_keys(client, [key(i) for i in range(10)])
    transport = _DropOnce()
    async with OffloadClient(server.url, transport=transport) as flaky:
        stream = flaky.events(last_event_id=start, retry_delay_s=0.01)
        items = await collect(stream, 10)
        await stream.aclose()
    assert [e.seq for e in items if isinstance(e, EngineEvent)] == list(
        range(start + 1, start + 11)
    )
    assert len(transport.resume_headers) == 2
    resumed_from = transport.resume_headers[1]
    assert resumed_from is not None and start < int(resumed_from.rsplit("-", 1)[1]) < start + 10


async def test_resuming_with_an_id_of_a_previous_run_gets_a_restart_gap_then_everything(
    client: OffloadClient,
) -> None:
    """A client resuming across a service restart hears about it and loses no new event."""
    ids: list[str] = []
    with running_server() as previous:  # the previous run of the service
        async with OffloadClient(previous.url) as old:
            for i in range(30):  # it got further than the new run will
                await old.put_blocks([key(500 + i)], [bytes(4096)])
            async with old._http.stream(
                "GET", "/v1/events", headers={"Last-Event-ID": "0"}
            ) as response:
                async for line in response.aiter_lines():
                    if line.startswith("id: "):
                        ids.append(line[4:])
                    if len(ids) == 30:
                        break
    first = await last_seq(client) + 1
    await store_keys(client, [key(i) for i in range(3)])
    stream = client.events(last_event_id=ids[-1], reconnect=False)
    items: list[EngineEvent | GapMarker] = []
    with anyio.fail_after(10):
        async for item in stream:
            items.append(item)
            if isinstance(item, EngineEvent) and item.seq == first + 2:
                break
    await stream.aclose()
    gap, *events = items
    assert isinstance(gap, GapMarker) and gap.restarted
    seqs = [e.seq for e in events if isinstance(e, EngineEvent)]
    assert seqs == list(range(gap.next_seq, first + 3))  # every event this run still keeps


async def test_expired_lease_is_visible_as_an_event(client: OffloadClient) -> None:
    start = await last_seq(client)
    lease = await client.prepare_store([key(1)], ttl_s=0.2)
    stream = client.events(types=[EventType.LEASE_EXPIRED], last_event_id=start)
    (event,) = await collect(stream, 1)
    await stream.aclose()
    assert isinstance(event, EngineEvent) and event.type is EventType.LEASE_EXPIRED
    assert event.detail["lease_id"] == lease.lease_id and event.keys == [key(1)]
    assert (await client.lookup([key(1)])).hits == 0


async def test_unknown_event_type_answers_422(client: OffloadClient) -> None:
    r = await client._http.get("/v1/events", params={"types": "stored,bogus"})
    assert r.status_code == 422
    r = await client._http.get("/v1/events", headers={"Last-Event-ID": "x1"})
    assert r.status_code == 422


def test_idle_streams_get_heartbeat_comments(server: Server) -> None:
    import socket
    from urllib.parse import urlparse

    port = urlparse(server.url).port
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /v1/events HTTP/1.1\r\nHost: t\r\nAccept: text/event-stream\r\n\r\n")
        received = b""
        while b"\r\n: ping" not in received and b"\n: ping" not in received:
            chunk = sock.recv(4096)  # the socket timeout bounds the wait
            assert chunk, "server closed the stream"
            received += chunk
    assert received.startswith(b"HTTP/1.1 200")
