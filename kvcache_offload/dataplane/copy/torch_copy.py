"""The portable copy path: plain torch ops, no kernel of our own, no per-fragment Python.

For each batch of fragments: ``index_select`` gathers the source rows into a contiguous
staging buffer on the source device, one bulk ``copy_`` moves the staging bytes to the
destination device when the devices differ (through pinned host memory), and
``index_copy_`` scatters them into the destination rows. Work is vectorised per *piece*: one
layer (ref) of one group at one sub-block position, so a job costs a few torch calls per
layer, not one per fragment.

Rows are copied in the widest integer dtype (8, 4, 2 or 1 bytes) that divides every size,
stride and address involved, which is what makes torch's CPU index kernels fast.

This is the CPU backend's copy and the CUDA handlers' fallback when neither the Triton
kernel nor the batched DMA is available (or when asked for explicitly).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from kvcache_offload.dataplane.copy.plan import (
    CopySides,
    SideGeometry,
    TransferPlan,
)

__all__ = ["TorchCopier"]

_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
_STAGING_ALIGN = 16


def _pow2_align(value: int) -> int:
    for k in (8, 4, 2):
        if value % k == 0:
            return k
    return 1


@dataclass
class _Piece:
    tensor: int
    size: int
    width: int
    src_sub: int
    dst_sub: int
    src_rows: torch.Tensor
    dst_rows: torch.Tensor


class TorchCopier:
    """Copies plans between two lists of 2-D int8 tensors with torch ops only.

    Not thread-safe: one copier per direction, used by one thread at a time (it owns its
    staging buffers). ``max_staging_bytes`` bounds the staging memory per batch.
    """

    def __init__(self, sides: CopySides, *, max_staging_bytes: int = 256 * 1024 * 1024) -> None:
        self.src_tensors = list(sides.src)
        self.dst_tensors = list(sides.dst)
        self.src_geom, self.dst_geom = sides.geometry()
        self.src_device = self.src_tensors[0].device
        self.dst_device = self.dst_tensors[0].device
        self.cross_device = self.src_device != self.dst_device
        self.max_staging_bytes = max(int(max_staging_bytes), _STAGING_ALIGN)
        self._src_align = [self._tensor_align(self.src_geom, t) for t in range(len(sides.src))]
        self._dst_align = [self._tensor_align(self.dst_geom, t) for t in range(len(sides.dst))]
        self._wide: dict[tuple[int, int, int], torch.Tensor] = {}
        self._src_stage: torch.Tensor | None = None
        self._dst_stage: torch.Tensor | None = None

    @staticmethod
    def _tensor_align(geom: SideGeometry, t: int) -> int:
        return min(
            _pow2_align(int(geom.base[t])),
            _pow2_align(int(geom.row_stride[t])),
            _pow2_align(int(geom.sub_bytes[t])),
        )

    # -- views ------------------------------------------------------------------------------
    def _flat(self, side: int, t: int, width: int) -> torch.Tensor:
        """The tensor's whole storage as a 1-D tensor of ``width``-byte integers."""
        key = (side, t, width)
        flat = self._wide.get(key)
        if flat is None:
            tensor = (self.src_tensors if side == 0 else self.dst_tensors)[t]
            storage = tensor.untyped_storage()
            flat = torch.empty(0, dtype=_DTYPES[width], device=tensor.device)
            flat.set_(storage, 0, (storage.nbytes() // width,), (1,))
            self._wide[key] = flat
        return flat

    def _rows_view(self, side: int, t: int, width: int, sub: int, size: int) -> torch.Tensor:
        """``(num_rows, size/width)`` view of sub-block ``sub`` of every row of tensor t."""
        tensor = (self.src_tensors if side == 0 else self.dst_tensors)[t]
        geom = self.src_geom if side == 0 else self.dst_geom
        offset = tensor.storage_offset() + sub * int(geom.sub_bytes[t])
        return torch.as_strided(
            self._flat(side, t, width),
            (tensor.shape[0], size // width),
            (int(geom.row_stride[t]) // width, 1),
            offset // width,
        )

    def _stage(self, which: int, nbytes: int) -> torch.Tensor:
        device = self.src_device if which == 0 else self.dst_device
        current = self._src_stage if which == 0 else self._dst_stage
        if current is None or current.numel() < nbytes:
            cap = max(nbytes, 1 << 20)
            cap = -(-cap // _STAGING_ALIGN) * _STAGING_ALIGN
            pin = self.cross_device and device.type == "cpu" and torch.cuda.is_available()
            current = torch.empty(cap, dtype=torch.uint8, device=device, pin_memory=pin)
            if which == 0:
                self._src_stage = current
            else:
                self._dst_stage = current
        return current

    # -- planning ---------------------------------------------------------------------------
    def _pieces(self, plan: TransferPlan) -> Iterator[_Piece]:
        sf, df = self.src_geom.factor, self.dst_geom.factor
        cap = self.max_staging_bytes
        for g in plan.groups:
            s_rows, s_sub = np.divmod(g.src_units, sf)
            d_rows, d_sub = np.divmod(g.dst_units, df)
            key = s_sub * df + d_sub
            if sf > 1 or df > 1:
                order = np.argsort(key, kind="stable")
                s_rows, d_rows, key = s_rows[order], d_rows[order], key[order]
            bounds = np.flatnonzero(np.diff(key)) + 1
            starts = np.concatenate([[0], bounds]).tolist()
            stops = [*bounds.tolist(), len(key)]
            src_idx = torch.from_numpy(np.ascontiguousarray(s_rows)).to(self.src_device)
            dst_idx = torch.from_numpy(np.ascontiguousarray(d_rows)).to(self.dst_device)
            for t, size in zip(g.ref_tensors.tolist(), g.ref_sizes.tolist(), strict=True):
                width = min(_pow2_align(size), self._src_align[t], self._dst_align[t])
                step = max(1, cap // size)
                for lo, hi in zip(starts, stops, strict=True):
                    k = int(key[lo])
                    for a in range(lo, hi, step):
                        b = min(hi, a + step)
                        yield _Piece(t, size, width, k // df, k % df, src_idx[a:b], dst_idx[a:b])

    # -- copying ----------------------------------------------------------------------------
    def run(self, plan: TransferPlan, stream: torch.cuda.Stream | None = None) -> None:
        """Copy every fragment of ``plan``; returns when the bytes are in place."""
        batch: list[tuple[_Piece, int]] = []
        used = 0
        for piece in self._pieces(plan):
            nbytes = len(piece.src_rows) * piece.size
            if batch and used + nbytes > self.max_staging_bytes:
                self._run_batch(batch, used, stream)
                batch, used = [], 0
            batch.append((piece, used))
            used += -(-nbytes // _STAGING_ALIGN) * _STAGING_ALIGN
        if batch:
            self._run_batch(batch, used, stream)

    def _run_batch(
        self, batch: list[tuple[_Piece, int]], used: int, stream: torch.cuda.Stream | None
    ) -> None:
        src_stage = self._stage(0, used)
        dst_stage = self._stage(1, used) if self.cross_device else src_stage
        for piece, off in batch:
            out = self._stage_view(src_stage, piece, off)
            view = self._rows_view(0, piece.tensor, piece.width, piece.src_sub, piece.size)
            torch.index_select(view, 0, piece.src_rows, out=out)
        if self.cross_device:
            dst_stage[:used].copy_(src_stage[:used], non_blocking=True)
            if self.dst_device.type == "cpu" and stream is not None:
                stream.synchronize()  # the D2H copy must land before the CPU scatter
        for piece, off in batch:
            src = self._stage_view(dst_stage, piece, off)
            view = self._rows_view(1, piece.tensor, piece.width, piece.dst_sub, piece.size)
            view.index_copy_(0, piece.dst_rows, src)
        if stream is not None:
            stream.synchronize()  # staging is reused by the next batch

    @staticmethod
    def _stage_view(stage: torch.Tensor, piece: _Piece, off: int) -> torch.Tensor:
        n = len(piece.src_rows)
        flat = stage[off : off + n * piece.size]
        return flat.view(_DTYPES[piece.width]).view(n, piece.size // piece.width)
