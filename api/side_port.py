"""The service's read-only endpoints on a side port inside the vLLM process.

The vLLM plug-in asks for this server by name (``integrations/vllm/_side_port.py``), so the
library never imports the service. vLLM owns the process's main thread and its own event
loop; the side port gets a daemon thread with a loop of its own, serving the service's app
(:func:`~kvcache_offload_service.app.create_app`) over an :class:`EngineView` behind a gate
that lets through only the routes that read: ``/metrics`` (the same metric names as the
service, so the Grafana dashboard works unchanged), ``/v1/events`` (SSE), ``/v1/lookup``,
``/v1/stats``, ``/v1/region``, ``/healthz`` and ``/readyz``; anything else is a JSON 404.

The socket is bound before the thread starts, so a taken port fails vLLM's start-up with a
:class:`ConfigError`, and port 0 reports the port it got. :meth:`SidePort.stop` ends the event
streams, stops the server, joins its thread and closes the socket: the port is free again
when it returns. The owner calls it when vLLM shuts its manager down and, at the latest, from
the spec's finalizer at process exit (a daemon thread, so exit never waits on it first).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from typing import TYPE_CHECKING, cast

import uvicorn

from kvcache_offload.errors import ConfigError
from kvcache_offload.integrations.vllm._engine_view import EngineView

from .app import create_app
from .responses import FastJSONResponse

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

    from kvcache_offload.aio.engine import OffloadEngine

__all__ = ["READ_ONLY_ROUTES", "SidePort"]

logger = logging.getLogger(__name__)

READ_ONLY_ROUTES = frozenset(
    {
        ("GET", "/metrics"),
        ("GET", "/v1/events"),
        ("POST", "/v1/lookup"),
        ("GET", "/v1/stats"),
        ("GET", "/v1/region"),
        ("GET", "/healthz"),
        ("GET", "/readyz"),
    }
)
"""(method, path) of the service's routes the side port serves; ``POST /v1/lookup`` reads."""

_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 10.0
_GRACEFUL_SHUTDOWN_S = 2


class SidePort:
    """Serves ``view`` on ``host:port`` from its own thread until :meth:`stop`."""

    def __init__(self, view: EngineView, host: str, port: int) -> None:
        try:
            self._socket = socket.create_server((host, port))
        except OSError as exc:
            raise ConfigError(
                f"cannot serve kvcache-offload's observability on {host}:{port}: {exc}"
            ) from None
        self.host, self.port = self._socket.getsockname()[:2]
        self._view = view
        # The view has what the read routes use; the gate answers every other route 404.
        engine = cast("OffloadEngine", view)
        app = _ReadOnlyGate(create_app(engine, config=view.config))
        self._server = uvicorn.Server(
            uvicorn.Config(
                app,
                log_config=None,
                access_log=False,
                lifespan="on",
                timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
            )
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(
            target=self._run, name=f"kvcache-offload-side-port-{self.port}", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT_S):
            self.stop()
            raise ConfigError(f"the observability side port did not start in {_START_TIMEOUT_S} s")
        logger.info("kvcache-offload observability on %s", self.url)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except Exception:
            logger.exception("the kvcache-offload observability side port failed")
        finally:
            self._socket.close()  # never a bound port nobody answers on
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._view.attach(self._loop)
        self._ready.set()  # the socket already listens: early clients wait in its backlog
        try:
            await self._server.serve(sockets=[self._socket])
        finally:
            self._view.close()

    def stop(self) -> None:
        """End the streams, stop serving and free the port (idempotent, any thread)."""
        if self._stopped:
            return
        self._stopped = True
        loop = self._loop
        if loop is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop may have ended already
                loop.call_soon_threadsafe(self._view.close)  # SSE streams end, so does serve()
            self._server.should_exit = True
            if threading.current_thread() is not self._thread:
                self._thread.join(_STOP_TIMEOUT_S)
                if self._thread.is_alive():
                    logger.warning("the observability side port did not stop in time")
        self._socket.close()


class _ReadOnlyGate:
    """Passes the read routes (and the lifespan) to the app; answers anything else 404.

    A gate in front of the app, not a copy of its routers: the service's routes stay the
    service's, and no route that changes the tier can be reached however the app grows.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["method"], scope["path"]) not in READ_ONLY_ROUTES:
            detail = (
                f"{scope['method']} {scope['path']} is not served on the vLLM side port, which "
                f"only reads: {', '.join(sorted(f'{m} {p}' for m, p in READ_ONLY_ROUTES))}"
            )
            await FastJSONResponse({"error": "NotFound", "detail": detail}, status_code=404)(
                scope, receive, send
            )
            return
        await self.app(scope, receive, send)
