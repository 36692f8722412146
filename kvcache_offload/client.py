"""Async HTTP client of the kvcache-offload service, one method per endpoint.

Errors come back as the library's own exceptions (``CapacityError`` for 507, ``LeaseError``
for an unknown lease, ...), named by the server's ``error`` field, so code written against the
embedded engine handles the remote one the same way. :meth:`OffloadClient.events` follows the
server-sent-event feed and, after a dropped connection, resumes with ``Last-Event-ID`` so no
event is lost while the server's ring buffer still holds it (a ``GapMarker`` says otherwise).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Sequence
from typing import Any, TypedDict

import anyio
import httpx
from typing_extensions import Unpack

from kvcache_offload import errors as _errors
from kvcache_offload._closing import AsyncClosing
from kvcache_offload.aio.types import (
    EngineEvent,
    EventType,
    GapMarker,
    LoadLease,
    LookupResult,
    StoreLease,
    StoreResult,
)
from kvcache_offload.aio.wire import from_wire
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import NoSharedRegionError, OffloadError

__all__ = ["CopyReport", "OffloadClient", "ServiceError", "TokenSource", "parse_event"]


class ServiceError(OffloadError):
    """An HTTP error with no library counterpart (auth, validation, limits, not ready)."""

    def __init__(self, status: int, error: str, detail: Any) -> None:
        super().__init__(f"HTTP {status} {error}: {detail}")
        self.status = status
        self.error = error
        self.detail = detail


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        body = response.json()
        name, detail = str(body.get("error", "")), body.get("detail", "")
    except ValueError:
        name, detail = "", response.text
    cls = getattr(_errors, name, None)
    if isinstance(cls, type) and issubclass(cls, OffloadError):
        raise cls(detail)
    raise ServiceError(response.status_code, name or "HTTPError", detail)


KeysArg = Sequence[OffloadKey | bytes | str] | None
"""Blocks named by key: keys, their bytes or hex (None: named by ``token_ids`` instead)."""


class TokenSource(TypedDict, total=False):
    """Keyword arguments naming blocks by token ids instead of keys (the service derives
    chained keys; see docs/http-api.md), plus the request id policies may use."""

    token_ids: Sequence[int] | None
    block_size: int | None
    group_idx: int
    salt: str | None
    req_id: str


def _keys_body(keys: KeysArg, source: TokenSource) -> dict[str, Any]:
    unknown = source.keys() - TokenSource.__annotations__.keys()
    if unknown:
        raise TypeError(f"unexpected keyword arguments {sorted(unknown)}")
    body: dict[str, Any] = {}
    if keys is not None:
        body["keys"] = [k if isinstance(k, str) else bytes(k).hex() for k in keys]
    token_ids = source.get("token_ids")
    if token_ids is not None:
        body.update(
            token_ids=list(token_ids),
            block_size=source.get("block_size"),
            group_idx=source.get("group_idx", 0),
        )
        if source.get("salt") is not None:
            body["salt"] = source["salt"]
    if source.get("req_id"):
        body["req_id"] = source["req_id"]
    return body


def _keys(hexes: list[str]) -> list[OffloadKey]:
    return [OffloadKey(bytes.fromhex(h)) for h in hexes]


def parse_event(event: str, data: dict[str, Any]) -> EngineEvent | GapMarker:
    """One SSE message (event name + decoded JSON data) as an engine event or a gap marker."""
    if event == "gap":
        return GapMarker(
            missed=int(data["missed"]),
            next_seq=int(data["next_seq"]),
            restarted=bool(data.get("restarted", False)),
        )
    return EngineEvent(
        seq=int(data["seq"]),
        timestamp=float(data["timestamp"]),
        type=EventType(data["type"]),
        keys=_keys(data.get("keys", [])),
        medium=str(data.get("medium", "CPU")),
        detail=dict(data.get("detail") or {}),
    )


def _ttl(body: dict[str, Any], ttl_s: float | None) -> dict[str, Any]:
    if ttl_s is not None:
        body["ttl_s"] = ttl_s
    return body


class CopyReport(TypedDict, total=False):
    """What a sidecar client's own copy moved, so the server's transfer metrics include it."""

    transfer_bytes: int | None
    transfer_seconds: float | None


def _completion(lease_id: str, report: CopyReport, **fields: Any) -> dict[str, Any]:
    body = {"lease_id": lease_id, **fields}
    body.update((name, value) for name, value in report.items() if value is not None)
    return body


class OffloadClient(AsyncClosing):
    """``async with OffloadClient("http://127.0.0.1:8000") as c: await c.lookup(keys)``."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        token: str | None = None,
        timeout: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=headers, timeout=timeout, transport=transport
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        response = await self._http.post(path, json=body)
        _raise_for(response)
        return response.json()

    async def _get(self, path: str) -> httpx.Response:
        response = await self._http.get(path)
        _raise_for(response)
        return response

    # -- keys --------------------------------------------------------------------------------

    async def lookup(self, keys: KeysArg = None, **source: Unpack[TokenSource]) -> LookupResult:
        """The ready prefix of ``keys`` (or of the blocks of ``token_ids``)."""
        return from_wire(LookupResult, await self._post("/v1/lookup", _keys_body(keys, source)))

    async def touch(self, keys: KeysArg = None, **source: Unpack[TokenSource]) -> int:
        out = await self._post("/v1/touch", _keys_body(keys, source))
        return int(out["touched"])

    async def discard(
        self, keys: KeysArg = None, **source: Unpack[TokenSource]
    ) -> list[OffloadKey]:
        """Free blocks nobody will ask for again (a finished session's own keys); returns
        the keys freed."""
        out = await self._post("/v1/discard", _keys_body(keys, source))
        return _keys(out["discarded"])

    async def release(self, keys: KeysArg = None, **source: Unpack[TokenSource]) -> int:
        """Evict these blocks first when room is needed, unless asked for again."""
        out = await self._post("/v1/release", _keys_body(keys, source))
        return int(out["released"])

    # -- leases ------------------------------------------------------------------------------

    async def prepare_store(
        self,
        keys: KeysArg = None,
        *,
        ttl_s: float | None = None,
        **source: Unpack[TokenSource],
    ) -> StoreLease:
        body = _keys_body(keys, source)
        return from_wire(StoreLease, await self._post("/v1/store/prepare", _ttl(body, ttl_s)))

    async def complete_store(
        self, lease_id: str, success: bool = True, **report: Unpack[CopyReport]
    ) -> list[OffloadKey]:
        """Complete a store; report your copy's size and time to feed transfer metrics."""
        body = _completion(lease_id, report, success=success)
        return _keys((await self._post("/v1/store/complete", body))["keys"])

    async def prepare_load(
        self,
        keys: KeysArg = None,
        *,
        ttl_s: float | None = None,
        **source: Unpack[TokenSource],
    ) -> LoadLease:
        body = _keys_body(keys, source)
        return from_wire(LoadLease, await self._post("/v1/load/prepare", _ttl(body, ttl_s)))

    async def complete_load(self, lease_id: str, **report: Unpack[CopyReport]) -> None:
        """Unpin the lease's blocks; the copy report is as in :meth:`complete_store`."""
        await self._post("/v1/load/complete", _completion(lease_id, report))

    # -- block bytes -------------------------------------------------------------------------

    async def put_blocks(
        self, keys: Sequence[OffloadKey | bytes], data: Sequence[bytes]
    ) -> StoreResult:
        """Upload blocks (each exactly the server's block size) through the manager."""
        response = await self._http.put(
            "/v1/blocks",
            params=[("keys", bytes(k).hex()) for k in keys],
            content=b"".join(data),
            headers={"Content-Type": "application/octet-stream"},
        )
        _raise_for(response)
        return from_wire(StoreResult, response.json())

    async def get_block(self, key: OffloadKey | bytes) -> bytes:
        return (await self._get(f"/v1/blocks/{bytes(key).hex()}")).content

    # -- service -----------------------------------------------------------------------------

    async def region(self) -> dict[str, Any]:
        """The shared region's description (``RegionError`` when the server has none)."""
        response = await self._http.get("/v1/region")
        if response.status_code == 404:
            raise NoSharedRegionError(str(response.json().get("detail", "no shared region")))
        _raise_for(response)
        out: dict[str, Any] = response.json()
        return out

    async def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = (await self._get("/v1/stats")).json()
        return out

    async def reset(self) -> None:
        await self._post("/v1/reset", {})

    async def healthz(self) -> bool:
        return (await self._http.get("/healthz")).status_code == 200

    async def readyz(self) -> bool:
        return (await self._http.get("/readyz")).status_code == 200

    async def metrics_text(self) -> str:
        return (await self._get("/metrics")).text

    # -- events ------------------------------------------------------------------------------

    async def events(
        self,
        types: Collection[EventType | str] | None = None,
        *,
        last_event_id: str | int | None = None,
        reconnect: bool = True,
        max_retries: int = 10,
        retry_delay_s: float = 0.2,
        queue_size: int | None = None,
    ) -> AsyncIterator[EngineEvent | GapMarker]:
        """Events in order; after a dropped connection, resume after the last id seen.

        Ids carry the server run's epoch: resuming across a service restart yields a
        :class:`GapMarker` with ``restarted=True``, then every event of the new run.

        ``max_retries`` consecutive failed reconnects end the iteration with the last error.
        """
        params: dict[str, Any] = {}
        if types:
            params["types"] = ",".join(str(EventType(t).value) for t in types)
        if queue_size is not None:
            params["queue_size"] = queue_size
        last_id = last_event_id
        failures = 0
        while True:
            headers = {"Accept": "text/event-stream"}
            if last_id is not None:
                headers["Last-Event-ID"] = str(last_id)
            try:
                async with self._http.stream(
                    "GET", "/v1/events", params=params, headers=headers, timeout=None
                ) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        _raise_for(response)
                    failures = 0
                    async for msg_id, item in _read_sse(response):
                        if msg_id is not None:
                            last_id = msg_id
                        yield item
            except (httpx.TransportError, httpx.RemoteProtocolError):
                if not reconnect:
                    raise
                failures += 1
                if failures > max_retries:
                    raise
                await anyio.sleep(retry_delay_s)
                continue
            if not reconnect:
                return
            failures += 1
            if failures > max_retries:
                return
            await anyio.sleep(retry_delay_s)


async def _read_sse(
    response: httpx.Response,
) -> AsyncIterator[tuple[str | None, EngineEvent | GapMarker]]:
    """(id, item) per SSE message; comments (heartbeats) are skipped."""
    import json

    msg_id: str | None = None
    event = "message"
    data: list[str] = []
    async for line in response.aiter_lines():
        if not line:
            if data:
                item = parse_event(event, json.loads("\n".join(data)))
                yield (msg_id or None), item
            msg_id, event, data = None, "message", []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "id":
            msg_id = value
        elif field == "event":
            event = value
        elif field == "data":
            data.append(value)
