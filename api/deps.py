"""What the routers need from the app: the engine (as a protocol) and the configuration."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, Protocol

from starlette.requests import Request

from kvcache_offload.aio.types import (
    EngineStats,
    EventType,
    LoadLease,
    LookupResult,
    StoreLease,
    StoreResult,
)
from kvcache_offload.config import OffloadConfig
from kvcache_offload.contracts.manager import ReqContext
from kvcache_offload.contracts.offload_key import OffloadKey

__all__ = ["EngineLike", "EngineNotReady", "get_config", "get_engine"]


class EngineLike(Protocol):
    """The slice of ``OffloadEngine`` the HTTP layer calls; anything shaped so can be served."""

    @property
    def block_nbytes(self) -> int: ...

    async def lookup(
        self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None
    ) -> LookupResult: ...

    async def touch(
        self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None
    ) -> None: ...

    async def prepare_store(
        self,
        keys: Sequence[OffloadKey],
        req_context: ReqContext | None = None,
        ttl_s: float | None = None,
    ) -> StoreLease: ...

    async def complete_store(
        self,
        lease_id: str,
        success: bool = True,
        transfer_bytes: int | None = None,
        transfer_seconds: float | None = None,
    ) -> list[OffloadKey]: ...

    async def prepare_load(
        self,
        keys: Sequence[OffloadKey],
        req_context: ReqContext | None = None,
        ttl_s: float | None = None,
    ) -> LoadLease: ...

    async def complete_load(
        self,
        lease_id: str,
        transfer_bytes: int | None = None,
        transfer_seconds: float | None = None,
    ) -> None: ...

    async def write_blocks(
        self, keys: Sequence[OffloadKey], data: Sequence[bytes | bytearray | memoryview]
    ) -> StoreResult: ...

    async def read_block(self, key: OffloadKey) -> bytes: ...

    def region_info(self) -> dict[str, Any] | None: ...

    async def reset(self) -> None: ...

    def stats(self) -> EngineStats: ...

    def subscribe(
        self,
        types: Collection[EventType] | None = None,
        since_seq: int | None = None,
        queue_size: int | None = None,
    ) -> Any: ...

    async def aclose(self) -> None: ...


# Dependencies are ``async def`` on purpose: FastAPI runs plain ``def`` ones in a worker thread.


class EngineNotReady(Exception):
    """The app's engine is not started (lifespan not run) or already closed."""


async def get_engine(request: Request) -> EngineLike:
    engine: EngineLike | None = getattr(request.app.state, "engine", None)
    if engine is None:
        raise EngineNotReady("the offload engine is not running (starting up or shut down)")
    return engine


async def get_config(request: Request) -> OffloadConfig:
    config: OffloadConfig = request.app.state.config
    return config
