"""The served process's heap: start-up objects frozen out of the garbage collector's reach.

After start-up the service holds tens of thousands of long-lived objects (FastAPI, pydantic,
the engine, imported modules) that never become garbage. CPython's older-generation
collections traverse all of them, pausing the event loop mid-request (up to ~60 ms per full
collection on 2 vCPUs). :class:`FrozenStartupHeap` wraps the app for ``serve``: when the
lifespan reports start-up complete it collects once and ``gc.freeze()``s what survived, so
later collections only traverse objects made while serving. Shutdown unfreezes them again.
Only ``serve`` uses it: freezing is process-wide, an embedding application decides for itself.
"""

from __future__ import annotations

import gc
from typing import Any

__all__ = ["FrozenStartupHeap"]

Scope = dict[str, Any]
Message = dict[str, Any]


class FrozenStartupHeap:
    """ASGI wrapper; see the module docstring. ``frozen`` counts the objects frozen."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.frozen = 0

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def freeze_after_startup(message: Message) -> None:
            kind = message.get("type")
            if kind == "lifespan.startup.complete":
                gc.collect()
                gc.freeze()
                self.frozen = gc.get_freeze_count()
            elif kind in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
                gc.unfreeze()
                self.frozen = 0
            await send(message)

        await self.app(scope, receive, freeze_after_startup)
