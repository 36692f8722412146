"""HTTP service over ``OffloadEngine``: a thin adapter, no cache logic lives here.

``create_app`` loads on first use, so that ``kvcache-offload serve --help`` works where the
``server`` extra (FastAPI, uvicorn) is not installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
