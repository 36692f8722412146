"""``create_app``: the FastAPI application over one ``OffloadEngine``.

Given an engine, the app serves it and leaves its lifetime to the caller. Given a config (or
nothing: defaults, environment), the app owns an engine: it is started by the lifespan and
closed on shutdown, which releases the CPU tier and any shared region.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from kvcache_offload.aio.types import EngineStats
from kvcache_offload.config import OffloadConfig, load_config
from kvcache_offload.errors import OffloadError

from .auth import BearerAuthMiddleware, document_bearer
from .broadcast import EventBroadcaster
from .docs_pages import install_docs_pages
from .errors import install_error_handlers
from .hot_path import HotPathMiddleware
from .limits import BodyLimitMiddleware
from .metrics import HttpMetricsMiddleware, build_registry
from .observers import build_observers, close_observers
from .routes import blocks, events, info, keys, leases
from .routes import metrics as metrics_route
from .schemas import ErrorBody

if TYPE_CHECKING:
    from kvcache_offload.aio.engine import OffloadEngine

__all__ = ["create_app"]

logger = logging.getLogger("kvcache_offload_service")

OBSERVER_BUDGET = 0.1
"""Share of the event loop's time the miss-ratio curve and the shadow policies may take: under
saturation they shed requests instead of halving the lookup rate (bench: 0.39x -> 1.3x a bare
FastAPI route with 64-key lookups on 2 vCPUs)."""

NO_OTEL_TELEMETRY = {"tracing": False, "metrics": False, "logs": False}
"""FastAPI's OpenTelemetry spans, metrics and logs stay off: the service exports its own
Prometheus metrics (``/metrics``), and with them on FastAPI asks the OpenTelemetry globals
whether a provider is configured on every request (~4% of a served lookup's CPU). Releases
before that layer (the ``telemetry`` argument) have nothing to switch off."""
_TELEMETRY_OFF: dict[str, Any] = (
    {"telemetry": NO_OTEL_TELEMETRY}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text}
    for code, text in {
        401: "Missing or wrong bearer token.",
        404: "Unknown lease, block route or no shared region.",
        409: "A block is not in the state the call needs.",
        410: "The lease expired and was rolled back.",
        413: "Request body too large.",
        422: "Malformed request or too many keys.",
        429: "Too many open leases (max_open_leases).",
        502: "A transfer failed.",
        503: "Engine or region not available.",
        507: "The CPU tier cannot hold the blocks.",
    }.items()
}


def create_app(
    engine_or_config: OffloadEngine | OffloadConfig | None = None,
    *,
    config: OffloadConfig | None = None,
) -> FastAPI:
    """The HTTP service; see the module docstring for who owns the engine."""
    given_engine: OffloadEngine | None = None
    if isinstance(engine_or_config, OffloadConfig):
        config = engine_or_config
    elif engine_or_config is not None:
        given_engine = engine_or_config
        config = config or getattr(given_engine, "config", None)
    if config is None:
        config = load_config()
    cfg = config

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if given_engine is not None:
            app.state.engine = given_engine
            try:
                yield
            finally:
                await _stop_serving(app)
            return
        from kvcache_offload.aio import OffloadEngine

        observers = build_observers(cfg)
        started = False
        try:
            async with OffloadEngine(
                cfg, access_observers=observers, observer_budget=OBSERVER_BUDGET
            ) as engine:
                app.state.engine = engine
                started = True
                from .startup import startup_line

                logger.info(startup_line(cfg, engine))
                try:
                    yield
                finally:
                    await _stop_serving(app)
        except OffloadError as exc:
            if not started:  # reported in one line by api.startup.OneLineStartupErrors
                app.state.startup_error = exc
            raise
        finally:
            await close_observers(observers)

    app = FastAPI(
        title="kvcache-offload",
        summary="Offload LLM KV-cache blocks to CPU memory: lookup, store, load, events, metrics.",
        version=_version(),
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        **_TELEMETRY_OFF,
    )
    install_docs_pages(app)
    app.state.config = cfg
    app.state.engine = given_engine  # serving a given engine works without a lifespan too
    token = cfg.api_token.get_secret_value() if cfg.api_token is not None else ""
    app.state.api_token = token.encode() if token else None
    app.state.broadcaster = None
    app.state.startup_error = None

    def stats() -> EngineStats | None:
        engine: OffloadEngine | None = app.state.engine
        return None if engine is None else engine.stats()

    registry, http_metrics = build_registry(stats)
    app.state.registry = registry

    # Routers carry their "/v1" prefix themselves so route templates (metric labels) are full.
    for v1_router in (keys.router, leases.router, blocks.router, events.router, info.router):
        app.include_router(v1_router, responses=_ERRORS)
    app.include_router(info.health_router)
    app.include_router(metrics_route.router)

    install_error_handlers(app)
    app.add_middleware(HotPathMiddleware, state=app.state)
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=int(cfg.max_body_bytes),
        read_timeout_s=cfg.body_read_timeout_s,
        max_large_bodies=cfg.max_large_bodies,
    )
    if app.state.api_token is not None:
        app.add_middleware(BearerAuthMiddleware, token=app.state.api_token)
        document_bearer(app)
    app.add_middleware(HttpMetricsMiddleware, metrics=http_metrics)
    return app


async def _stop_serving(app: FastAPI) -> None:
    """Detach the engine and end the SSE streams, before the engine itself closes."""
    app.state.engine = None
    broadcaster: EventBroadcaster | None = app.state.broadcaster
    app.state.broadcaster = None
    if broadcaster is not None:
        broadcaster.end_streams()


def _version() -> str:
    from kvcache_offload import __version__

    return __version__
