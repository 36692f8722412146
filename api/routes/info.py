"""Read-mostly service endpoints: region description, stats, reset, health and readiness."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from starlette.exceptions import HTTPException

from api.deps import EngineLike, get_engine
from api.responses import FastJSONResponse

__all__ = ["health_router", "router"]

router = APIRouter(prefix="/v1", tags=["service"])
health_router = APIRouter(tags=["health"])

Engine = Annotated[EngineLike, Depends(get_engine)]


@router.get("/region")
async def region(engine: Engine) -> FastJSONResponse:
    """Where the shared /dev/shm region lives and how it is laid out, for worker processes."""
    info = engine.region_info()
    if info is None:
        raise HTTPException(404, "this server has no shared region (start it with shared_region)")
    return FastJSONResponse(info)


def _plain(value: Any) -> Any:
    """Stats as JSON-ready values (float dict keys become strings)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


@router.get("/stats")
async def stats(request: Request, engine: Engine) -> FastJSONResponse:
    """Every counter and gauge of the engine as one JSON document."""
    snapshot = request.app.state.stats() or engine.stats()
    return FastJSONResponse(_plain(dataclasses.asdict(snapshot)))


@router.post("/reset")
async def reset(engine: Engine) -> FastJSONResponse:
    """Drop every offloaded block."""
    await engine.reset()
    return FastJSONResponse({"reset": True})


@health_router.get("/healthz")
async def healthz() -> FastJSONResponse:
    """The process answers."""
    return FastJSONResponse({"status": "ok"})


@health_router.get("/readyz")
async def readyz(request: Request) -> FastJSONResponse:
    """The engine is running and can take requests."""
    engine = getattr(request.app.state, "engine", None)
    if engine is None or getattr(engine, "closed", False):
        return FastJSONResponse({"status": "not ready"}, status_code=503)
    return FastJSONResponse({"status": "ready"})
