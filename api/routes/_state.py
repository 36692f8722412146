"""The app's engine and config for hot routes, without FastAPI dependency injection."""

from __future__ import annotations

from starlette.datastructures import State
from starlette.requests import Request

from api.deps import EngineLike, EngineNotReady
from kvcache_offload.config import OffloadConfig

__all__ = ["config_of", "engine_of", "state_config", "state_engine"]


def state_engine(state: State) -> EngineLike:
    engine: EngineLike | None = state.engine
    if engine is None:
        raise EngineNotReady("the offload engine is not running (starting up or shut down)")
    return engine


def state_config(state: State) -> OffloadConfig:
    config: OffloadConfig = state.config
    return config


def engine_of(request: Request) -> EngineLike:
    return state_engine(request.app.state)


def config_of(request: Request) -> OffloadConfig:
    return state_config(request.app.state)
