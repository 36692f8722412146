"""The app's engine and config for hot routes, without FastAPI dependency injection."""

from __future__ import annotations

from starlette.requests import Request

from api.deps import EngineLike, EngineNotReady
from kvcache_offload.config import OffloadConfig

__all__ = ["config_of", "engine_of"]


def engine_of(request: Request) -> EngineLike:
    engine: EngineLike | None = request.app.state.engine
    if engine is None:
        raise EngineNotReady("the offload engine is not running (starting up or shut down)")
    return engine


def config_of(request: Request) -> OffloadConfig:
    config: OffloadConfig = request.app.state.config
    return config
