"""StagingConfig: the knobs of the staged copy path (ring size, submit thread, auto choice).

Kept apart from :mod:`~kvcache_offload.dataplane.copy.staged` so that configuration code can
read and build it without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_STAGING_CONFIG", "MiB", "StagingConfig"]

MiB = 1024 * 1024


@dataclass(frozen=True)
class StagingConfig:
    chunk_bytes: int = 64 * MiB
    """Bytes of one staging buffer (rounded up to hold at least one CPU block)."""
    depth: int = 2
    """Staging buffers per direction (GPU memory: ``depth * chunk_bytes``)."""
    submit_thread: bool = True
    """Issue chunks from a dedicated thread (``transfer_async`` only queues the job)."""
    yield_s: float = 20e-6
    """The submit thread sleeps this long after issuing each chunk, so that the other
    direction's thread and the caller can take the GIL between chunks; 0: no pause. (On the
    H200 bench, one job per direction, 0, 20 and 100 us measured the same within noise; the
    thread stays far ahead of the copy engine either way.)"""
    throttle: bool = True
    """The submit thread issues a chunk only once its ring slot's previous use finished on the
    GPU (polling the slot's event with short sleeps). Issuing a whole job at once keeps the
    thread on the GIL for ~0.15 ms per chunk, which slowed the other direction's thread
    preparing its job (~1.2 ms instead of ~0.4 ms) when a store and a load start together;
    the GPU never waits for the host either way (a chunk takes ~1 ms on the link)."""
    auto_min_piece_bytes: int | None = 256 * 1024
    """``auto`` picks the staged path for a small-fragment job whose DMA pieces average at
    least this many bytes; None: never."""


DEFAULT_STAGING_CONFIG = StagingConfig()
