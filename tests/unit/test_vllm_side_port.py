"""The vLLM plug-in's observability side port, driven without vLLM.

The adapter's backend is built as the vLLM spec builds it, with ``observability_port``; the
manager calls vLLM's scheduler would make come from another thread, and the service's
endpoints answer from the side port: metrics move, events stream, lookup and stats answer,
the tier cannot be changed from there, and stopping frees the port.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from kvcache_offload.config import KVCacheLayout
from kvcache_offload.contracts.manager import ReqContext
from kvcache_offload.contracts.offload_key import make_offload_key
from kvcache_offload.errors import ConfigError
from kvcache_offload.integrations.vllm._backend import OffloadBackend
from kvcache_offload.integrations.vllm._settings import offload_config, side_port_settings
from tests.vllm._side_port_client import port_is_free, read_events, sample, scrape

LAYOUT = KVCacheLayout(gpu_block_sizes=[16], bytes_per_block=2048, world_size=1)
KEYS = [make_offload_key(bytes([i]) * 8, 0) for i in range(1, 5)]
CTX = ReqContext(req_id="req-0")


def _backend(extra: dict, *, vllm_events: bool = False) -> OffloadBackend:
    side_port = side_port_settings(extra)
    config = offload_config(
        extra,
        layout=LAYOUT,
        block_size=None,
        enable_events=vllm_events or side_port is not None,
        engine_id="engine-unit",
    )
    return OffloadBackend(
        config, side_port=side_port, vllm_events=vllm_events, engine_id="engine-unit"
    )


@pytest.fixture
def backend() -> Iterator[OffloadBackend]:
    backend = _backend({"cpu_bytes_to_use": 64 * 2048, "observability_port": 0})
    try:
        yield backend
    finally:
        backend.shutdown()


def _on_another_thread(fn) -> None:  # type: ignore[no-untyped-def]
    """Run ``fn`` the way vLLM's scheduler thread would: not the test's, not the server's."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # re-raised on the test thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def _store_and_load(backend: OffloadBackend) -> None:
    manager = backend.manager()
    output = manager.prepare_store(KEYS[:3], CTX)
    assert output is not None
    manager.complete_store(output.keys_to_store, CTX)
    manager.prepare_load(KEYS[:2], CTX)
    manager.complete_load(KEYS[:2], CTX)
    for key in KEYS:
        manager.lookup(key, CTX)
    backend.count_finished("gpu_to_cpu", [_result(3 * 2048, 0.002)])


def _result(nbytes: int, seconds: float):  # type: ignore[no-untyped-def]
    from kvcache_offload.contracts.handler import TransferResult

    return TransferResult(job_id=1, success=True, transfer_size=nbytes, transfer_time=seconds)


def test_metrics_count_the_managers_calls_made_on_another_thread(backend: OffloadBackend) -> None:
    url = backend.manager() and backend.side_port.url
    before = scrape(url)
    assert sample(before, "kvcache_offload_store_blocks_completed_total") == 0
    assert sample(before, "kvcache_offload_capacity_blocks") == 64
    _on_another_thread(lambda: _store_and_load(backend))
    after = scrape(url)
    assert sample(after, "kvcache_offload_store_blocks_prepared_total") == 3
    assert sample(after, "kvcache_offload_store_blocks_completed_total") == 3
    assert sample(after, "kvcache_offload_load_blocks_completed_total") == 2
    assert sample(after, "kvcache_offload_lookups_total") == 4
    assert sample(after, "kvcache_offload_lookup_hit_blocks_total") == 3
    assert sample(after, "kvcache_offload_blocks", state="idle") == 3
    assert sample(after, "kvcache_offload_transfer_bytes_total", direction="gpu_to_cpu") == 6144
    assert sample(after, "kvcache_offload_events_published_total", type="stored") == 1
    assert sample(after, "kvcache_offload_events_published_total", type="load_completed") == 1


def test_events_stream_as_server_sent_events(backend: OffloadBackend) -> None:
    url = backend.manager() and backend.side_port.url
    _on_another_thread(lambda: _store_and_load(backend))
    stored, loaded = read_events(url, 2)
    assert stored["type"] == "stored"
    assert stored["keys"] == [k.hex() for k in KEYS[:3]]
    assert loaded["type"] == "load_completed"
    assert loaded["detail"] == {"req_id": "req-0"}


def test_lookup_and_stats_answer_without_counting_as_vllms_lookups(
    backend: OffloadBackend,
) -> None:
    url = backend.manager() and backend.side_port.url
    _on_another_thread(lambda: _store_and_load(backend))
    keys = [k.hex() for k in KEYS]
    answer = httpx.post(f"{url}/v1/lookup", json={"keys": keys}, timeout=10).json()
    assert answer == {"hits": 3, "pending": False, "states": ["ready"] * 3 + ["absent"]}
    stats = httpx.get(f"{url}/v1/stats", timeout=10).json()
    assert stats["lookups"] == 4  # vLLM's four, not the HTTP one
    assert stats["store_blocks_completed"] == 3
    assert stats["block_nbytes"] == 2048
    assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200


def test_the_side_port_cannot_change_the_tier(backend: OffloadBackend) -> None:
    url = backend.manager() and backend.side_port.url
    body = {"keys": [KEYS[0].hex()]}
    for path in ("/v1/reset", "/v1/touch", "/v1/leases/store", "/v1/blocks"):
        response = httpx.post(f"{url}{path}", json=body, timeout=10)
        assert response.status_code == 404, path
        assert response.json()["error"] == "NotFound"
    assert httpx.get(f"{url}/v1/stats", timeout=10).json()["blocks_idle"] == 0


def test_vllms_events_are_forwarded_only_when_vllm_drains_them() -> None:
    for vllm_events in (False, True):
        backend = _backend(
            {"cpu_bytes_to_use": 64 * 2048, "observability_port": 0}, vllm_events=vllm_events
        )
        try:
            manager = backend.manager()
            output = manager.prepare_store(KEYS[:1], CTX)
            assert output is not None
            manager.complete_store(output.keys_to_store, CTX)
            taken = [(e.keys, e.removed) for e in manager.take_events()]
            assert taken == ([([KEYS[0]], False)] if vllm_events else [])
        finally:
            backend.shutdown()


def test_shutting_the_manager_down_frees_the_port() -> None:
    backend = _backend({"cpu_bytes_to_use": 64 * 2048, "observability_port": 0})
    try:
        manager = backend.manager()
        side_port = backend.side_port
        stream_open = threading.Event()

        def stream() -> None:  # an SSE client connected during shutdown must not hold it up
            with httpx.stream("GET", f"{side_port.url}/v1/events", timeout=30) as response:
                stream_open.set()
                for _ in response.iter_lines():
                    pass

        client = threading.Thread(target=stream)
        client.start()
        assert stream_open.wait(10)
        assert not port_is_free(side_port.host, side_port.port)
        manager.shutdown()  # what vLLM's scheduler calls on shutdown
        client.join(10)
        assert not client.is_alive()
        assert port_is_free(side_port.host, side_port.port)
        assert backend.side_port is None
    finally:
        backend.shutdown()


def test_a_taken_port_is_a_config_error_naming_it() -> None:
    first = _backend({"cpu_bytes_to_use": 64 * 2048, "observability_port": 0})
    try:
        first.manager()
        port = first.side_port.port
        second = _backend({"cpu_bytes_to_use": 64 * 2048, "observability_port": port})
        try:
            with pytest.raises(ConfigError, match=str(port)):
                second.manager()
        finally:
            second.shutdown()
    finally:
        first.shutdown()


@pytest.mark.parametrize("port", [-1, 70000, "nine", 1.5, True])
def test_a_bad_observability_port_is_refused(port: object) -> None:
    with pytest.raises(ConfigError, match="observability_port"):
        side_port_settings({"observability_port": port})


def test_no_side_port_unless_asked_and_the_host_defaults_to_loopback() -> None:
    assert side_port_settings({"cpu_bytes_to_use": 1}) is None
    settings = side_port_settings({"observability_port": "9400"})
    assert settings is not None and (settings.host, settings.port) == ("127.0.0.1", 9400)


def test_the_api_token_guards_the_side_port_as_it_guards_the_service() -> None:
    backend = _backend(
        {"cpu_bytes_to_use": 64 * 2048, "observability_port": 0, "api_token": "s3cret"}
    )
    try:
        backend.manager()
        url = backend.side_port.url
        assert httpx.get(f"{url}/v1/stats", timeout=10).status_code == 401
        authorized = {"Authorization": "Bearer s3cret"}
        assert httpx.get(f"{url}/v1/stats", headers=authorized, timeout=10).status_code == 200
        assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200  # open, as served
    finally:
        backend.shutdown()


async def test_the_view_refuses_every_call_that_would_change_the_tier() -> None:
    from kvcache_offload.integrations.vllm._engine_view import EngineView, ReadOnlyError

    config = offload_config({}, layout=LAYOUT, block_size=None, enable_events=True, engine_id="e")
    view = EngineView(config, 2048)
    try:
        for call, args in [
            ("touch", (KEYS,)),
            ("prepare_store", (KEYS,)),
            ("complete_store", ("lease-1",)),
            ("prepare_load", (KEYS,)),
            ("complete_load", ("lease-1",)),
            ("write_blocks", (KEYS, [b"x"] * len(KEYS))),
            ("read_block", (KEYS[0],)),
            ("reset", ()),
        ]:
            with pytest.raises(ReadOnlyError, match=f"{call} is not served inside vLLM"):
                await getattr(view, call)(*args)
        with pytest.raises(AttributeError):
            view.no_such_call  # noqa: B018
    finally:
        view.close()
