"""Read-mostly service endpoints: region description, stats, reset, health and readiness."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.exceptions import HTTPException

from kvcache_offload.aio.types import EngineStats
from kvcache_offload.aio.wire import to_wire

from ..deps import EngineNotReady, engine_of
from ..responses import FastJSONResponse

__all__ = ["health_router", "router"]

router = APIRouter(prefix="/v1", tags=["service"])
health_router = APIRouter(tags=["health"])


@router.get("/region")
async def region(request: Request) -> FastJSONResponse:
    """Where the shared /dev/shm region lives and how it is laid out, for worker processes."""
    info = engine_of(request).region_info()
    if info is None:
        raise HTTPException(404, "this server has no shared region (start it with shared_region)")
    return FastJSONResponse(info)


@router.get("/stats", response_model=EngineStats)
async def stats(request: Request) -> FastJSONResponse:
    """Every counter and gauge of the engine as one JSON document."""
    return FastJSONResponse(to_wire(engine_of(request).stats()))


@router.post("/reset")
async def reset(request: Request) -> FastJSONResponse:
    """Drop every offloaded block."""
    await engine_of(request).reset()
    return FastJSONResponse({"reset": True})


@health_router.get("/healthz")
async def healthz() -> FastJSONResponse:
    """The process answers."""
    return FastJSONResponse({"status": "ok"})


@health_router.get("/readyz")
async def readyz(request: Request) -> FastJSONResponse:
    """The engine is running and can take requests."""
    try:
        ready = not engine_of(request).closed
    except EngineNotReady:
        ready = False
    if not ready:
        return FastJSONResponse({"status": "not ready"}, status_code=503)
    return FastJSONResponse({"status": "ready"})
