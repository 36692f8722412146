"""The one accessor for what a route needs from its app: the engine and the configuration.

Routes, the lookup fast path and the event stream all call :func:`engine_of` (and
:func:`config_of`) with the request or the app's ``state``. The engine is the library's
``OffloadEngine`` itself, so its signature is written once, in ``kvcache_offload/aio``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.datastructures import State
from starlette.requests import HTTPConnection

from .errors import EngineNotReady

if TYPE_CHECKING:
    from kvcache_offload.aio.engine import OffloadEngine
    from kvcache_offload.config import OffloadConfig

__all__ = ["EngineNotReady", "config_of", "engine_of"]


def _state(source: HTTPConnection | State) -> State:
    return source.app.state if isinstance(source, HTTPConnection) else source


def engine_of(source: HTTPConnection | State) -> OffloadEngine:
    """The running engine; :class:`EngineNotReady` (503) while starting up or shut down."""
    engine: OffloadEngine | None = _state(source).engine
    if engine is None:
        raise EngineNotReady("the offload engine is not running (starting up or shut down)")
    return engine


def config_of(source: HTTPConnection | State) -> OffloadConfig:
    config: OffloadConfig = _state(source).config
    return config
