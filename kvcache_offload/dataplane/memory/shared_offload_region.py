"""SharedOffloadRegion: one mmap'd ``/dev/shm`` area shared by all workers of an instance.

Layout (vLLM's, reference section 5): after a one-page header, row ``b`` holds
``worker0 cell | worker1 cell | ... | worker{M-1} cell`` of CPU slot ``b``; a cell is
``cpu_page_size`` bytes and holds, back to back, that worker's pages of every canonical
tensor (:meth:`create_next_view`, one call per canonical tensor, in order). Each worker
pre-faults only its own cells (``MADV_POPULATE_WRITE``, or touching one byte per page on
kernels without it), so pages land on its NUMA node and a full ``/dev/shm`` fails here with
a :class:`RegionError` instead of a ``SIGBUS`` later.

Each run of a region has its own file name (:mod:`kvcache_offload.dataplane.memory.region_files`).
How processes create, join, seal and unlink the file without leaking it, SIGKILL included,
is the handshake in :mod:`kvcache_offload.dataplane.memory.region_handshake`; the OS probes
it relies on are in :mod:`kvcache_offload.dataplane.memory.region_os`. A region
garbage-collected without ``cleanup()`` unlinks its unsealed file too.

All of this is plain blocking file/mmap work: the async core runs it in a thread.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import logging
import mmap
import os
import re
import socket
import subprocess
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from kvcache_offload.dataplane.memory.region_files import new_run_file, stable_stem
from kvcache_offload.dataplane.memory.region_handshake import MAX_RANKS, PAGE_SIZE, RegionHandshake
from kvcache_offload.dataplane.memory.region_os import free_bytes, gib
from kvcache_offload.errors import RegionError

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_SHM_DIR", "SharedOffloadRegion"]

logger = logging.getLogger(__name__)

DEFAULT_SHM_DIR = "/dev/shm"
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_live_regions: weakref.WeakSet[SharedOffloadRegion] = weakref.WeakSet()


@atexit.register
def _unlink_unsealed_at_exit() -> None:
    """A normal exit never leaves a region file behind, even without ``cleanup()``."""
    for region in list(_live_regions):
        with contextlib.suppress(Exception):
            if not region._closed and not region.sealed and region.is_creator:
                region._unlink_if_ours()


class SharedOffloadRegion(RegionHandshake):
    """One region file, mapped by every worker (and optionally a service) of an instance.

    ``rank`` is this worker's index (its cells and views); ``None`` maps every row without a
    cell of its own (e.g. the sidecar service reading and writing whole blocks).
    """

    def __init__(
        self,
        name: str,
        num_blocks: int,
        cpu_page_size: int,
        num_workers: int = 1,
        rank: int | None = 0,
        *,
        shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR,
        expected_mappers: int | None = None,
        timeout_s: float = 30.0,
        populate: bool = True,
        pin: bool = False,
    ) -> None:
        if not _NAME_RE.match(name):
            raise RegionError(f"region name must match {_NAME_RE.pattern}, got {name!r}")
        if num_blocks <= 0 or cpu_page_size <= 0:
            raise RegionError(
                f"a region needs num_blocks > 0 and cpu_page_size > 0, got {num_blocks} and "
                f"{cpu_page_size} (a CPU budget too small for one block gives 0 blocks)"
            )
        if not 1 <= num_workers <= MAX_RANKS:
            raise RegionError(f"num_workers must be in [1, {MAX_RANKS}], got {num_workers}")
        if rank is not None and not 0 <= rank < num_workers:
            raise RegionError(f"rank must be in [0, {num_workers}) or None, got {rank}")
        self.name = name
        self.num_blocks = int(num_blocks)
        self.cpu_page_size = int(cpu_page_size)
        self.num_workers = int(num_workers)
        self.rank = rank
        self.shm_dir = str(shm_dir)
        self.path = new_run_file(self.shm_dir, name)
        """This run's file: made here by the creator, the newest one of ``name`` for a joiner."""
        self.row_stride = self.cpu_page_size * self.num_workers
        self.data_offset = PAGE_SIZE
        data = self.num_blocks * self.row_stride
        self.data_nbytes = data
        self.total_size_bytes = self.data_offset + -(-data // PAGE_SIZE) * PAGE_SIZE
        self.expected_mappers = expected_mappers
        self.is_creator = False
        self.is_pinned = False
        self.sealed = False
        self._closed = False
        self._fd: int | None = None
        self._ino: int | None = None
        self._mm: mmap.mmap | None = None
        self._np: np.ndarray | None = None
        self._base: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._sockets: list[socket.socket] = []
        self._pinned_ptr: int | None = None
        self._reaper: subprocess.Popen[bytes] | None = None
        if rank is not None:
            self._cursor = rank * self.cpu_page_size
            self._area_end = (rank + 1) * self.cpu_page_size
        else:
            self._cursor = self._area_end = 0
        key = hashlib.sha1(stable_stem(self.shm_dir, name).encode()).hexdigest()[:32]
        self._sock_base = f"kvcache_offload/{key}"
        try:
            self._open(timeout_s)
            if populate:
                self._populate()
            if pin:
                self.pin()
        except BaseException:
            self.cleanup()
            raise
        _live_regions.add(self)

    def _own_ranges(self) -> list[tuple[int, int]]:
        """Page-aligned (start, end) byte ranges of this process's cells, merged."""
        if self.rank is None:
            return [(self.data_offset, self.total_size_bytes)]
        starts = (
            self.data_offset
            + np.arange(self.num_blocks, dtype=np.int64) * self.row_stride
            + self.rank * self.cpu_page_size
        )
        ends = starts + self.cpu_page_size
        starts = (starts // PAGE_SIZE) * PAGE_SIZE
        ends = np.minimum(-(-ends // PAGE_SIZE) * PAGE_SIZE, self.total_size_bytes)
        ranges: list[tuple[int, int]] = []
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            if ranges and s <= ranges[-1][1]:
                ranges[-1] = (ranges[-1][0], max(ranges[-1][1], e))
            else:
                ranges.append((s, e))
        return ranges

    def _populate(self) -> None:
        assert self._mm is not None
        ranges = self._own_ranges()
        try:
            for s, e in ranges:
                self._mm.madvise(MADV_POPULATE_WRITE, s, e - s)
            return
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise self._populate_error(exc) from exc
        # Kernels before 5.14: touch one byte per page (read-modify-write keeps the bytes).
        need = sum(e - s for s, e in ranges)
        free = free_bytes(self.shm_dir)
        if free < need:
            raise self._populate_error(OSError(errno.ENOSPC, "not enough free space"))
        assert self._np is not None
        for s, e in ranges:
            pages = self._np[s:e:PAGE_SIZE]
            pages[...] = pages.copy()

    def _populate_error(self, exc: OSError) -> RegionError:
        try:
            free = gib(free_bytes(self.shm_dir))
        except OSError:
            free = "unknown"
        return RegionError(
            f"pre-faulting this worker's cells of {self.path} failed ({exc}); {self.shm_dir} "
            f"has {free} free for a region of {gib(self.total_size_bytes)}: enlarge it or "
            f"lower cpu_bytes_to_use"
        )

    def _base_tensor(self) -> torch.Tensor:
        """The whole mapping as a flat int8 tensor.

        Built from a numpy view so that every tensor view holds a buffer export of the mmap:
        ``mmap.close()`` then refuses (BufferError) while a view is alive, instead of
        unmapping memory a tensor still points at.
        """
        import torch

        if self._base is None:
            if self._mm is None:
                raise RegionError("the region is closed")
            self._base = torch.from_numpy(np.frombuffer(self._mm, dtype=np.int8))
        return self._base

    def create_next_view(self, tensor_page_size: int) -> torch.Tensor:
        """``(num_blocks, tensor_page_size)`` int8 view of this worker's next cell bytes.

        One call per canonical tensor, in order; the row stride is the whole row. Raises
        :class:`RegionError` (cursor unchanged) if the cell would overflow.
        """
        import torch

        if self.rank is None:
            raise RegionError("a region mapped without a rank has no cells of its own")
        if tensor_page_size <= 0:
            raise RegionError(f"tensor_page_size must be > 0, got {tensor_page_size}")
        new_cursor = self._cursor + int(tensor_page_size)
        if new_cursor > self._area_end:
            raise RegionError(
                f"worker offset {new_cursor} exceeds worker area end {self._area_end} "
                f"(overflowed by {new_cursor - self._area_end} bytes): the canonical tensors "
                f"need more than cpu_page_size={self.cpu_page_size} bytes per block"
            )
        view = torch.as_strided(
            self._base_tensor(),
            (self.num_blocks, int(tensor_page_size)),
            (self.row_stride, 1),
            self.data_offset + self._cursor,
        )
        self._cursor = new_cursor
        self._views.append(view)
        return view

    @property
    def cursor(self) -> int:
        """Offset within a row where the next view of this worker starts."""
        return self._cursor

    def rows_array(self) -> np.ndarray:
        """Every row as a zero-copy ``(num_blocks, row_stride)`` uint8 numpy view."""
        if self._np is None:
            raise RegionError("the region is closed")
        data = self._np[self.data_offset : self.data_offset + self.data_nbytes]
        return data.reshape(self.num_blocks, self.row_stride)

    def rows_memoryview(self) -> memoryview:
        """Every row as a zero-copy 2-D memoryview ``(num_blocks, row_stride)``."""
        if self._mm is None:
            raise RegionError("the region is closed")
        flat = memoryview(self._mm)[self.data_offset : self.data_offset + self.data_nbytes]
        return flat.cast("B", (self.num_blocks, self.row_stride))

    def pin(self) -> bool:
        """``cudaHostRegister`` the data area (mapped for the UVA kernel); warn on failure."""
        if self.is_pinned:
            return True
        if self._np is None:
            raise RegionError("the region is closed")
        try:
            from kvcache_offload.dataplane.copy.dma import get_cuda_runtime

            runtime = get_cuda_runtime()
        except Exception as exc:  # torch missing, no CUDA
            runtime = None
            why = str(exc)
        else:
            why = "the CUDA runtime is unavailable"
        if runtime is None:
            logger.warning("not pinning region %s: %s; transfers will be slower", self.path, why)
            return False
        ptr = int(self._np.ctypes.data) + self.data_offset
        ok, msg = runtime.host_register(ptr, self.total_size_bytes - self.data_offset)
        if not ok:
            logger.warning(
                "cudaHostRegister of region %s failed (%s): transfers will still work but may "
                "be slower (unpinned DMA)",
                self.path,
                msg,
            )
            return False
        self._pinned_ptr = ptr
        self.is_pinned = True
        return True

    def _unpin(self) -> None:
        if self._pinned_ptr is None:
            return
        from kvcache_offload.dataplane.copy.dma import get_cuda_runtime

        runtime = get_cuda_runtime()
        if runtime is not None:
            ok, msg = runtime.host_unregister(self._pinned_ptr)
            if not ok:
                logger.warning("cudaHostUnregister of region %s failed: %s", self.path, msg)
        self._pinned_ptr = None
        self.is_pinned = False

    def describe(self) -> dict[str, Any]:
        return {
            "region": self.name,
            "path": self.path,
            "num_workers": self.num_workers,
            "rank": self.rank,
            "num_blocks": self.num_blocks,
            "cpu_page_size": self.cpu_page_size,
            "row_stride": self.row_stride,
            # Block b, worker w starts at data_offset + b * row_stride + w * cpu_page_size.
            "data_offset": self.data_offset,
            "total_size_bytes": self.total_size_bytes,
            "creator": self.is_creator,
            "sealed": self.sealed,
            "pinned": self.is_pinned,
        }

    def cleanup(self) -> None:
        """Unpin, unmap, close, and unlink the file if it is still ours. Idempotent.

        Views handed out must be dropped by their holders first; if some are still alive the
        mapping is released when they are garbage-collected (a warning says so).
        """
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._unpin()
        self._views.clear()
        self._base = None
        self._np = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                logger.warning(
                    "region %s still has live views; its mapping is released once they are "
                    "garbage-collected",
                    self.path,
                )
            self._mm = None
        if self._fd is not None:
            if not self.sealed and (self.is_creator or not self._held("creator")):
                self._unlink_if_ours()
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()
        self._sockets.clear()
        self._stop_reaper()

    def __enter__(self) -> SharedOffloadRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def __del__(self) -> None:
        """Garbage-collected without ``cleanup()``: an unsealed file of ours goes too."""
        with contextlib.suppress(Exception):
            if not self._closed:
                if self.is_creator and not self.sealed:
                    self._unlink_if_ours()
                for sock in self._sockets:
                    sock.close()
                self._stop_reaper()
