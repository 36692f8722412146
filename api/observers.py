"""Access observers of a served engine: the live miss-ratio curve, the shadow policies and
the optional recorder.

The service exports ``kvcache_offload_mrc_*`` and ``kvcache_offload_shadow_*`` and can record
its request stream for ``kvcache-offload replay`` (``record_path``); all are engine access
observers, built here from the configuration when the app owns its engine.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio

from kvcache_offload.config import OffloadConfig

__all__ = ["build_observers", "close_observers"]

logger = logging.getLogger(__name__)


def build_observers(config: OffloadConfig) -> list[Any]:
    """A ``MissRatioCurve`` always, plus a ``RequestRecorder`` when ``record_path`` is set."""
    from kvcache_offload.lab.mrc import MissRatioCurve

    observers: list[Any] = [MissRatioCurve(sample_rate=config.mrc_sample_rate)]
    if config.shadow_policies:
        from kvcache_offload.lab.shadow import ShadowPolicies

        observers.append(
            ShadowPolicies(
                config.shadow_policies,
                live=config.eviction_policy,
                store_threshold=config.store_threshold,
                sample_blocks=config.shadow_sample_blocks,
            )
        )
    if config.record_path is not None:
        from kvcache_offload.lab.recorder import RequestRecorder

        observers.append(RequestRecorder(config.record_path))
    return observers


async def close_observers(observers: list[Any]) -> None:
    """Flush and close observers that hold files or threads (off the event loop)."""
    for observer in observers:
        close = getattr(observer, "close", None)
        if callable(close):
            try:
                await anyio.to_thread.run_sync(close)
            except Exception:
                logger.exception("closing observer %r failed", observer)
