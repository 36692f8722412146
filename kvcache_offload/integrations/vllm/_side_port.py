"""Where the vLLM plug-in gets its observability side port: from the service, by name.

The side port serves the service's own app (``/metrics``, ``/v1/events``, the read routes)
inside the vLLM process, so its server belongs to the service (``api/side_port.py``). The
library names it here and imports it only when ``observability_port`` asks for one, so it
never imports the service; without the ``server`` extra the request fails with a
:class:`ConfigError` that names the extra.
"""

from __future__ import annotations

from typing import Protocol

from kvcache_offload._imports import import_object
from kvcache_offload.errors import ConfigError
from kvcache_offload.integrations.vllm._engine_view import EngineView

__all__ = ["SIDE_PORT_SERVER", "RunningSidePort", "start_side_port"]

SIDE_PORT_SERVER = "kvcache_offload_service.side_port:SidePort"
"""The server class, ``(view, host, port) -> RunningSidePort``, installed with ``[server]``."""


class RunningSidePort(Protocol):
    """A side port serving from its own thread until :meth:`stop` (idempotent, any thread)."""

    host: str
    port: int

    @property
    def url(self) -> str: ...

    def stop(self) -> None: ...


def start_side_port(view: EngineView, host: str, port: int) -> RunningSidePort:
    """Serve ``view`` on ``host:port``; the port is bound when this returns."""
    try:
        server = import_object(SIDE_PORT_SERVER)
    except ImportError as exc:
        raise ConfigError(
            f"observability_port needs the service's web stack ({exc.name} is missing): "
            "pip install 'kvcache-offload[server]'"
        ) from None
    if not callable(server):
        raise ConfigError(f"{SIDE_PORT_SERVER} is {server!r}, not a side port server")
    started: RunningSidePort = server(view, host, port)
    return started
