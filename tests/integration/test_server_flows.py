"""End to end against a real uvicorn server: leases, block bytes, auth, metrics, shutdown."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcache_offload.client import OffloadClient, ServiceError
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import BlockStateError, CapacityError, LeaseError
from kvcache_offload.keys import token_block_keys
from tests.integration._server import BLOCK_BYTES, CAPACITY_BLOCKS, Server, running_server

TOKEN = "integration-token"


def key(i: int) -> OffloadKey:
    return OffloadKey(i.to_bytes(8, "big") + b"\0\0\0\0")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running_server("--api-token", TOKEN) as srv:
        yield srv


@pytest.fixture
async def client(server: Server) -> AsyncIterator[OffloadClient]:
    async with OffloadClient(server.url, token=TOKEN) as c:
        await c.reset()
        yield c


async def test_sidecar_store_and_load_round_trip(client: OffloadClient) -> None:
    keys = [key(i) for i in range(4)]
    lease = await client.prepare_store(keys)
    assert lease.keys_to_store == keys and len(lease.block_ids) == 4
    assert (await client.lookup(keys)).pending
    assert await client.complete_store(lease.lease_id) == keys
    hit = await client.lookup([*keys, key(99)])
    assert hit.hits == 4 and not hit.pending
    load = await client.prepare_load(keys[:2])
    assert load.block_ids == lease.block_ids[:2]
    await client.complete_load(load.lease_id)
    with pytest.raises(LeaseError):
        await client.complete_load(load.lease_id)


async def test_token_id_requests_use_the_documented_keys(client: OffloadClient) -> None:
    tokens = list(range(64))
    lease = await client.prepare_store(token_ids=tokens, block_size=16, salt="t")
    assert lease.keys_to_store == token_block_keys(tokens, 16, salt="t")
    await client.complete_store(lease.lease_id)
    assert (await client.lookup(token_ids=tokens, block_size=16, salt="t")).hits == 4
    assert (await client.lookup(token_ids=tokens, block_size=16)).hits == 0


async def test_errors_come_back_as_library_exceptions(client: OffloadClient) -> None:
    with pytest.raises(BlockStateError):
        await client.prepare_load([key(1)])
    everything = await client.prepare_store([key(i) for i in range(CAPACITY_BLOCKS)])
    with pytest.raises(CapacityError):
        await client.prepare_store([key(1000)])
    await client.complete_store(everything.lease_id, success=False)  # frees the slots now
    with pytest.raises(ServiceError) as info:
        await client.lookup(["xyz"])
    assert info.value.status == 422


async def test_block_bytes_round_trip_over_http(client: OffloadClient) -> None:
    blobs = [bytes([i]) * BLOCK_BYTES for i in range(3)]
    keys = [key(100 + i) for i in range(3)]
    result = await client.put_blocks(keys, blobs)
    assert result.keys_stored == keys
    for k, blob in zip(keys, blobs, strict=True):
        assert await client.get_block(k) == blob
    with pytest.raises(ServiceError) as info:
        await client.put_blocks([key(200)], [b"short"])
    assert info.value.status == 422
    with pytest.raises(BlockStateError):
        await client.get_block(key(201))


async def test_requests_without_the_token_are_refused(server: Server) -> None:
    async with OffloadClient(server.url) as anonymous:
        with pytest.raises(ServiceError) as info:
            await anonymous.lookup([key(1)])
        assert info.value.status == 401
        assert await anonymous.healthz()


async def test_metrics_parse_and_move_with_the_traffic(client: OffloadClient) -> None:
    def lookups(text: str) -> float:
        for family in text_string_to_metric_families(text):
            if family.name == "kvcache_offload_lookups":
                return float(family.samples[0].value)
        raise AssertionError("kvcache_offload_lookups_total missing")

    before = lookups(await client.metrics_text())
    for _ in range(3):
        await client.lookup([key(1)])
    text = await client.metrics_text()
    assert lookups(text) == before + 3
    assert (
        'kvcache_offload_http_requests_total{method="POST",route="/v1/lookup",status="200"}' in text
    )


async def test_metrics_say_which_manager_build_serves(client: OffloadClient) -> None:
    from kvcache_offload import __version__, compiled_modules

    text = await client.metrics_text()
    (family,) = [
        f for f in text_string_to_metric_families(text) if f.name == "kvcache_offload_build_info"
    ]
    (sample,) = family.samples
    build = "compiled" if all(compiled_modules().values()) else "python"
    assert sample.labels == {"version": __version__, "manager": build}
    assert sample.value == 1


def test_sigterm_runs_the_lifespan_shutdown_that_closes_the_engine() -> None:
    with running_server("--log-level", "info") as srv:
        code = srv.stop()
        output = srv.process.stdout.read().decode() if srv.process.stdout else ""
    # uvicorn re-raises the caught SIGTERM after a clean shutdown, hence -SIGTERM.
    assert code in (0, -signal.SIGTERM), output
    assert "Application shutdown complete" in output


def test_sigterm_with_an_open_event_stream_still_shuts_down_promptly() -> None:
    import socket
    import time
    from urllib.parse import urlparse

    with running_server("--log-level", "info") as srv:
        port = urlparse(srv.url).port
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /v1/events HTTP/1.1\r\nHost: t\r\nAccept: text/event-stream\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            started = time.monotonic()
            code = srv.stop(timeout=15)
            elapsed = time.monotonic() - started
        output = srv.process.stdout.read().decode() if srv.process.stdout else ""
    assert code in (0, -signal.SIGTERM), output
    assert "Application shutdown complete" in output
    assert elapsed < 10


def test_idle_and_half_sent_requests_are_closed_after_the_header_deadline() -> None:
    import socket
    from urllib.parse import urlparse

    env = {"KVCACHE_OFFLOAD_HEADER_READ_TIMEOUT_S": "0.5"}
    with running_server(env=env) as srv:
        port = urlparse(srv.url).port
        idle = socket.create_connection(("127.0.0.1", port), timeout=10)
        partial = socket.create_connection(("127.0.0.1", port), timeout=10)
        partial.sendall(b"GET /hea")
        for sock in (idle, partial):
            with sock:
                assert sock.recv(100) == b""  # closed by the server, well before the timeout


def test_sigterm_answers_slow_bodies_503_and_ends_event_streams_cleanly() -> None:
    import socket
    import time
    from urllib.parse import urlparse

    with running_server("--log-level", "info") as srv:
        port = urlparse(srv.url).port
        events = socket.create_connection(("127.0.0.1", port), timeout=10)
        events.sendall(b"GET /v1/events HTTP/1.1\r\nHost: t\r\nAccept: text/event-stream\r\n\r\n")
        assert events.recv(4096).startswith(b"HTTP/1.1 200")
        slow = socket.create_connection(("127.0.0.1", port), timeout=10)
        slow.sendall(
            b"POST /v1/lookup HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{"
        )
        assert httpx.get(f"{srv.url}/healthz", timeout=10).status_code == 200
        started = time.monotonic()
        code = srv.stop(timeout=15)
        elapsed = time.monotonic() - started
        answer = slow.recv(4096)
        tail = b""
        while chunk := events.recv(4096):
            tail += chunk
        slow.close()
        events.close()
        output = srv.process.stdout.read().decode() if srv.process.stdout else ""
    assert code in (0, -signal.SIGTERM), output
    assert answer.startswith(b"HTTP/1.1 503") and b"ShuttingDown" in answer
    assert tail.endswith(b"0\r\n\r\n")  # the chunked event stream was finished, not cut
    assert "ERROR" not in output and "Traceback" not in output, output
    assert elapsed < 4  # not held until the 5 s graceful timeout
