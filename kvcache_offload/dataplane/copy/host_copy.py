"""The CPU backend's copy: every fragment of a job moved once, in one call without the GIL.

Both sides of a CPU-backend job are host memory, so the shortest path is a ``memcpy`` per
fragment straight from its source to its destination (no staging, each byte read and
written once). A small C extension (``_hostcopy.c``, built with the package) computes each
fragment's addresses from the refs' columns and the plan's units (the arithmetic of
:meth:`TransferPlan.fill_pointer_table`, which costs more Python per serving-size job than
the copy) and copies with the GIL released for the whole group, so a copy thread never
queues for the GIL behind the event loop between fragments. Without the extension (no C
compiler at install time) the pointer table is built and walked with a ``ctypes.memmove``
per fragment: the same bytes, slower.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from kvcache_offload.dataplane.copy.plan import (
    CopySides,
    TransferPlan,
)
from kvcache_offload.errors import TransferError

__all__ = ["HostCopier", "NativeCopyQueue", "flat_int64", "native_available"]

try:
    from kvcache_offload.dataplane.copy._hostcopy import CopyQueue as NativeCopyQueue
    from kvcache_offload.dataplane.copy._hostcopy import copy_fragments as _copy_fragments
    from kvcache_offload.dataplane.copy._hostcopy import copy_units as _copy_units
except ImportError:  # pragma: no cover - exercised where the extension is not built
    NativeCopyQueue = None
    _copy_fragments = None
    _copy_units = None


def native_available() -> bool:
    """True when the GIL-free C walk is built (else a ``ctypes.memmove`` per fragment)."""
    return _copy_fragments is not None


_INT64 = np.dtype(np.int64)


def flat_int64(units: np.ndarray) -> np.ndarray:
    """``units`` as ``copy_units`` and ``CopyQueue.submit`` take them: the planners' own
    arrays (native int64, contiguous) as they are, without a numpy call per job; anything
    else converted."""
    if units.dtype is _INT64 and units.flags.c_contiguous:
        return units
    return np.ascontiguousarray(units, dtype=np.int64)


class HostCopier:
    """Copies plans between two lists of 2-D int8 host tensors, one ``memcpy`` per fragment.

    The tensors must stay alive while the copier is used (it copies by address). Not
    thread-safe: one copier per direction, used by one thread at a time (it reuses its
    pointer table).
    """

    def __init__(self, sides: CopySides, streaming: bool = False) -> None:
        """``streaming``: write the destination with non-temporal stores (the C walk only),
        for copies into the CPU tier, whose bytes are not read again soon: a store then
        neither reads every destination line first nor evicts what the engine works on."""
        self._keep: CopySides | None = sides
        self.src_geom, self.dst_geom = sides.geometry()
        self.streaming = streaming
        self._table = np.empty((3, 0), dtype=np.int64)
        self._columns: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, tuple[Any, ...]]] = {}
        """``ref_columns`` by the ids of a group's ref arrays: a handler's plans pass the same
        two arrays job after job, and gathering the columns again cost five numpy calls."""

    def release(self) -> None:
        """Let go of the tensors (the handlers shut down first): a later copy raises
        :class:`TransferError` instead of writing to memory that may be freed."""
        self._keep = None
        self._columns.clear()

    def _check_open(self) -> None:
        if self._keep is None:
            raise TransferError("the host copier was released (its handlers are shut down)")

    def ref_columns(self, ref_tensors: np.ndarray, ref_sizes: np.ndarray) -> tuple[Any, ...]:
        """What the C copy needs of a group's refs before its units: each side's base, row
        stride and sub-block columns and factor, then the sizes (``copy_units``' and
        ``CopyQueue.add_group``'s leading arguments)."""
        self._check_open()
        sb, sst, ssub = self.src_geom.of_refs(ref_tensors).flat
        db, dst, dsub = self.dst_geom.of_refs(ref_tensors).flat
        return (
            sb, sst, ssub, self.src_geom.factor,
            db, dst, dsub, self.dst_geom.factor,
            np.ascontiguousarray(ref_sizes, dtype=np.int64),
        )  # fmt: skip

    def _cached_columns(self, ref_tensors: np.ndarray, ref_sizes: np.ndarray) -> tuple[Any, ...]:
        """:meth:`ref_columns`, kept per pair of arrays (the arrays with it, so ids stay valid;
        numpy arrays the plans share are never written after the handler built them)."""
        key = (id(ref_tensors), id(ref_sizes))
        hit = self._columns.get(key)
        if hit is not None and hit[0] is ref_tensors and hit[1] is ref_sizes:
            return hit[2]
        columns = self.ref_columns(ref_tensors, ref_sizes)
        if len(self._columns) < 64:
            self._columns[key] = (ref_tensors, ref_sizes, columns)
        return columns

    def run(self, plan: TransferPlan, _token: object = None) -> None:
        """Copy every fragment of ``plan``; returns when the bytes are in place. (``_token``
        is ignored: it lets a handler call this as its ``run_plan`` without a wrapper.)"""
        n = plan.num_fragments
        if n == 0:
            return
        if _copy_units is not None:  # addresses computed in C: no pointer table per job
            cache = self._columns
            for g in plan.groups:
                refs, sizes, src, dst = g.ref_tensors, g.ref_sizes, g.src_units, g.dst_units
                if len(refs) == 0 or len(src) == 0:
                    continue
                # _cached_columns and flat_int64 inline for the planners' own arrays (one
                # copy per small job: three calls less).
                hit = cache.get((id(refs), id(sizes)))
                if hit is not None and hit[0] is refs and hit[1] is sizes:
                    columns = hit[2]
                else:
                    columns = self._cached_columns(refs, sizes)
                if src.dtype is not _INT64 or not src.flags.c_contiguous:
                    src = flat_int64(src)
                if dst.dtype is not _INT64 or not dst.flags.c_contiguous:
                    dst = flat_int64(dst)
                _copy_units(*columns, src, dst, self.streaming)
            return
        self._check_open()
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
