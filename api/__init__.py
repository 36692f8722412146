"""HTTP service over ``OffloadEngine``: a thin adapter, no cache logic lives here."""

from .app import create_app

__all__ = ["create_app"]
