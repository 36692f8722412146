"""The CPU backend's copy: every fragment of a job moved once, in one call without the GIL.

Both sides of a CPU-backend job are host memory, so the shortest path is a ``memcpy`` per
fragment straight from its source to its destination (no staging, each byte read and
written once). The plan's pointer table (:meth:`TransferPlan.fill_pointer_table`, the same
arithmetic the batched DMA uses) names every fragment; a small C extension
(``_hostcopy.c``, built with the package) walks it with the GIL released for the whole job,
so a copy thread never queues for the GIL behind the event loop between fragments. Without
the extension (no C compiler at install time) the walk is a ``ctypes.memmove`` per fragment:
the same bytes, a little slower for jobs of many small fragments.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kvcache_offload.dataplane.copy.plan import (
    CopySides,
    TransferPlan,
)

__all__ = ["HostCopier", "native_available"]

try:
    from kvcache_offload.dataplane.copy._hostcopy import copy_fragments as _copy_fragments
except ImportError:  # pragma: no cover - exercised where the extension is not built
    _copy_fragments = None


def native_available() -> bool:
    """True when the GIL-free C walk is built (else a ``ctypes.memmove`` per fragment)."""
    return _copy_fragments is not None


class HostCopier:
    """Copies plans between two lists of 2-D int8 host tensors, one ``memcpy`` per fragment.

    The tensors must stay alive while the copier is used (it copies by address). Not
    thread-safe: one copier per direction, used by one thread at a time (it reuses its
    pointer table).
    """

    def __init__(self, sides: CopySides) -> None:
        self._keep = sides
        self.src_geom, self.dst_geom = sides.geometry()
        self._table = np.empty((3, 0), dtype=np.int64)

    def run(self, plan: TransferPlan) -> None:
        """Copy every fragment of ``plan``; returns when the bytes are in place."""
        n = plan.num_fragments
        if n == 0:
            return
        if self._table.shape[1] < n:
            self._table = np.empty((3, max(n, 2 * self._table.shape[1])), dtype=np.int64)
        table = plan.fill_pointer_table(self.src_geom, self.dst_geom, self._table)
        if _copy_fragments is not None:
            _copy_fragments(
                np.ascontiguousarray(table[0]),
                np.ascontiguousarray(table[1]),
                np.ascontiguousarray(table[2]),
            )
            return
        memmove = ctypes.memmove
        for src, dst, size in zip(
            table[0].tolist(), table[1].tolist(), table[2].tolist(), strict=True
        ):
            memmove(dst, src, size)
