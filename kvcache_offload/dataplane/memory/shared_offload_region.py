"""SharedOffloadRegion: one mmap'd ``/dev/shm`` area shared by all workers of an instance.

Layout (vLLM's, reference section 5): after a one-page header, row ``b`` holds
``worker0 cell | worker1 cell | ... | worker{M-1} cell`` of CPU slot ``b``; a cell is
``cpu_page_size`` bytes and holds, back to back, that worker's pages of every canonical
tensor (:meth:`create_next_view`, one call per canonical tensor, in order). Each worker
pre-faults only its own cells (``MADV_POPULATE_WRITE``, or touching one byte per page on
kernels without it), so pages land on its NUMA node and a full ``/dev/shm`` fails here with
a :class:`RegionError` instead of a ``SIGBUS`` later.

Creator/joiner protocol, and what it fixes compared with vLLM:

* The *creator* is the process that binds the abstract Unix socket named after the region
  (Linux; released by the kernel when the process dies, SIGKILL included, so it never
  leaks). It checks ``/dev/shm`` free space first (vLLM #46949), removes a stale file left
  by a crashed run (there is no live creator, so it is stale: #54002), creates the file with
  ``O_CREAT | O_EXCL``, sizes it and writes the header.
* *Joiners* open the file, wait for the header to be ready, check that the geometry matches
  theirs, and register in the header under a ``lockf`` lock (rank bitmap + counter).
* When the counter reaches the expected number of mappers, whoever completed it unlinks
  the file: every process keeps its mapping, and from then on a SIGKILL of any of them, the
  creator included, leaves nothing in ``/dev/shm`` (vLLM #51579, #54002, #57303). The
  sealer also binds a second abstract name, so a joiner that arrives after the seal gets
  a clear "too late" :class:`RegionError` at once.
* Until the seal, a tiny reaper child (``/bin/sh``) of the creator unlinks the file if the
  creator dies first, SIGKILL included; a region garbage-collected without ``cleanup()``
  unlinks its unsealed file too. A second mapper without a rank (a second *service* on the
  same region name) is refused with a :class:`RegionError` rather than sharing the blocks.
* Liveness probes ``connect`` to the abstract names instead of binding them, so concurrent
  probes never see each other as the holder.
* Expected mappers: ``num_workers`` when the creator is a worker (has a rank), plus one
  when the creator has no rank (a sidecar service that maps every row); override with
  ``expected_mappers``.

All of this is plain blocking file/mmap work: the async core runs it in a thread.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import re
import socket
import struct
import subprocess
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvcache_offload.errors import RegionError

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_SHM_DIR", "SharedOffloadRegion"]

logger = logging.getLogger(__name__)

DEFAULT_SHM_DIR = "/dev/shm"
PAGE_SIZE = mmap.PAGESIZE
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)

_MAGIC = b"KVOFFRG1"
_HEADER = struct.Struct("<8sIIQQQQIIIIQ")
# magic, state, version, creator_pid, creator_start, num_blocks, cpu_page_size,
# num_workers, expected, joined, sealed, data_offset
_SERVICE_OFFSET = 127
"""One header byte: 1 once a mapper without a rank (a service) has joined."""
_BITMAP_OFFSET = 128
_MAX_RANKS = (PAGE_SIZE - _BITMAP_OFFSET) * 8
_STATE_READY = 1
_VERSION = 1
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_POLL_S = 0.005
_register_lock = threading.Lock()
_live_regions: weakref.WeakSet[SharedOffloadRegion] = weakref.WeakSet()


@atexit.register
def _unlink_unsealed_at_exit() -> None:
    """A normal exit never leaves a region file behind, even without ``cleanup()``."""
    for region in list(_live_regions):
        with contextlib.suppress(Exception):
            if not region._closed and not region.sealed and region.is_creator:
                region._unlink_if_ours()


_REAPER_SCRIPT = (
    'cat >/dev/null; i=$(stat -c %i -- "$1" 2>/dev/null) && [ "$i" = "$2" ] && rm -f -- "$1"'
)


def _start_reaper(path: str, inode: int) -> subprocess.Popen[bytes] | None:
    """A tiny child that unlinks the unsealed file once this process is gone, SIGKILL included.

    It waits for end-of-file on a pipe only this process writes; the pipe closes when the
    region is sealed or cleaned up, or when the process dies. It then removes ``path`` only
    if it still names the file we created (same inode), so a newer region is never touched.
    """
    try:
        return subprocess.Popen(
            ["/bin/sh", "-c", _REAPER_SCRIPT, "kvcache-offload-region-reaper", path, str(inode)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to the foreground group does not end it first
        )
    except OSError as exc:
        logger.warning("no reaper for region file %s (%s): a SIGKILL may leak it", path, exc)
        return None


def _proc_start_time(pid: int) -> int:
    """Start time of a process in clock ticks (0 when unknown): guards against pid reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def _pid_alive(pid: int, start: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not start or _proc_start_time(pid) in (0, start)


def _free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return int(st.f_bavail) * int(st.f_frsize)


def _gib(n: float) -> str:
    return f"{n / 1024**3:.2f} GiB"


class SharedOffloadRegion:
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
        if not 1 <= num_workers <= _MAX_RANKS:
            raise RegionError(f"num_workers must be in [1, {_MAX_RANKS}], got {num_workers}")
        if rank is not None and not 0 <= rank < num_workers:
            raise RegionError(f"rank must be in [0, {num_workers}) or None, got {rank}")
        self.name = name
        self.num_blocks = int(num_blocks)
        self.cpu_page_size = int(cpu_page_size)
        self.num_workers = int(num_workers)
        self.rank = rank
        self.shm_dir = str(shm_dir)
        self.path = os.path.join(self.shm_dir, f"kvcache_offload_{name}.mmap")
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
        key = hashlib.sha1(os.path.realpath(self.path).encode()).hexdigest()[:32]
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

    # -- protocol -----------------------------------------------------------------------------
    def _bind(self, suffix: str) -> socket.socket | None:
        """Bind an abstract Unix socket; None if a live process holds the name."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(f"\0{self._sock_base}/{suffix}")
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                return None
            raise RegionError(f"cannot bind the region's liveness socket: {exc}") from exc
        return sock

    def _held(self, suffix: str) -> bool:
        """Whether a live process holds the name: a ``connect``, which never takes the name.

        (Probing by binding it briefly made two concurrent probes see each other as the
        holder: a racing joiner was told "too late", a racing creator became a joiner.)
        """
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.connect(f"\0{self._sock_base}/{suffix}")
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError as exc:
            raise RegionError(f"cannot probe the region's liveness socket: {exc}") from exc
        finally:
            sock.close()
        return True

    def _open(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            lock = self._bind("creator")
            if lock is not None:
                self._sockets.append(lock)
                self.is_creator = True
                self._create()
                return
            try:
                fd = os.open(self.path, os.O_RDWR)
            except FileNotFoundError:
                if self._held("sealed"):
                    raise RegionError(self._late_message()) from None
                if time.monotonic() > deadline:
                    raise RegionError(
                        f"region {self.path} did not appear within {timeout_s:.0f}s although "
                        f"its creator is alive; if all expected workers already joined, it was "
                        f"unlinked (sealed) and this process is too late"
                    ) from None
                time.sleep(_POLL_S)
                continue
            self._fd = fd
            self._join(deadline, timeout_s)
            return

    def _late_message(self) -> str:
        return (
            f"region {self.name!r} ({self.path}) is already sealed: every expected worker "
            f"has mapped it and its file is unlinked; this process (rank {self.rank}) joined "
            f"too late. Start all workers together or raise expected_mappers."
        )

    def _expected(self) -> int:
        if self.expected_mappers is not None:
            return int(self.expected_mappers)
        return self.num_workers + (1 if self.rank is None else 0)

    def _create(self) -> None:
        if os.path.lexists(self.path):
            self._remove_stale()
        try:
            free = _free_bytes(self.shm_dir)
        except OSError as exc:
            raise RegionError(f"cannot inspect {self.shm_dir}: {exc}") from exc
        if free < self.total_size_bytes:
            raise RegionError(
                f"{self.shm_dir} has {_gib(free)} free but region {self.name!r} needs "
                f"{_gib(self.total_size_bytes)} ({self.num_blocks} blocks x "
                f"{self.row_stride} bytes per row for {self.num_workers} workers): lower "
                f"cpu_bytes_to_use, free space in {self.shm_dir}, or enlarge it (e.g. "
                f"docker run --shm-size)"
            )
        expected = self._expected()
        if not 1 <= expected <= _MAX_RANKS + 1:
            raise RegionError(f"expected_mappers must be >= 1, got {expected}")
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError as exc:  # pragma: no cover - only a non-participant can race
            raise RegionError(f"{self.path} appeared while creating it: {exc}") from exc
        except OSError as exc:
            raise RegionError(f"cannot create {self.path}: {exc}") from exc
        self._fd = fd
        self._ino = os.fstat(fd).st_ino
        self._reaper = _start_reaper(self.path, self._ino)
        try:
            os.ftruncate(fd, self.total_size_bytes)
        except OSError as exc:
            raise RegionError(
                f"cannot size {self.path} to {_gib(self.total_size_bytes)}: {exc}"
            ) from exc
        self._map(self.total_size_bytes)
        pid = os.getpid()
        header = _HEADER.pack(
            _MAGIC, 0, _VERSION, pid, _proc_start_time(pid), self.num_blocks,
            self.cpu_page_size, self.num_workers, expected, 0, 0, self.data_offset,
        )  # fmt: skip
        assert self._mm is not None
        self._mm[: _HEADER.size] = header
        self._register()
        self._write_state(_STATE_READY)
        logger.info(
            "created shared region %s: %s, %d blocks x %d workers x %d bytes",
            self.path, _gib(self.total_size_bytes), self.num_blocks, self.num_workers,
            self.cpu_page_size,
        )  # fmt: skip

    def _remove_stale(self) -> None:
        """The file exists but no live process holds the creator name: a crashed run."""
        info = ""
        try:
            with open(self.path, "rb") as f:
                raw = f.read(_HEADER.size)
            if len(raw) == _HEADER.size and raw[:8] == _MAGIC:
                fields = _HEADER.unpack(raw)
                pid, start = fields[3], fields[4]
                alive = _pid_alive(pid, start)
                info = f" (creator pid {pid}, {'still running' if alive else 'gone'})"
        except OSError:
            pass
        logger.warning("replacing stale region file %s left by a crashed run%s", self.path, info)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise RegionError(f"cannot remove stale region file {self.path}: {exc}") from exc

    def _join(self, deadline: float, timeout_s: float) -> None:
        assert self._fd is not None
        fd = self._fd
        self._ino = os.fstat(fd).st_ino
        while True:
            header = self._read_header_fd(fd)
            if header is not None and header[1] == _STATE_READY:
                break
            if not self._held("creator"):
                self._unlink_if_ours()
                raise RegionError(
                    f"the creator of region {self.path} died before it was ready; the "
                    f"stale file was removed, start again"
                )
            if time.monotonic() > deadline:
                raise RegionError(f"region {self.path} was not ready within {timeout_s:.0f}s")
            time.sleep(_POLL_S)
        (_, _, version, _, _, num_blocks, page, workers, _, _, _, data_offset) = header
        mine = (self.num_blocks, self.cpu_page_size, self.num_workers, self.data_offset)
        theirs = (num_blocks, page, workers, data_offset)
        if version != _VERSION or mine != theirs:
            raise RegionError(
                f"region {self.path} has (num_blocks, cpu_page_size, num_workers, data offset)"
                f" = {theirs} (version {version}), this process expects {mine}"
            )
        self._map(self.total_size_bytes)
        self._register()

    @staticmethod
    def _read_header_fd(fd: int) -> tuple[Any, ...] | None:
        try:
            raw = os.pread(fd, _HEADER.size, 0)
        except OSError:
            return None
        if len(raw) < _HEADER.size or raw[:8] != _MAGIC:
            return None
        return _HEADER.unpack(raw)

    def _map(self, size: int) -> None:
        assert self._fd is not None
        if os.fstat(self._fd).st_size < size:
            raise RegionError(f"{self.path} is smaller than the {size} bytes it should hold")
        self._mm = mmap.mmap(
            self._fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
        self._np = np.frombuffer(self._mm, dtype=np.uint8)

    def _write_state(self, state: int) -> None:
        assert self._mm is not None
        struct.pack_into("<I", self._mm, 8, state)

    def _register(self) -> None:
        """Count this mapper (and its rank) in; seal and unlink once everyone is in."""
        assert self._fd is not None and self._mm is not None
        fd, mm = self._fd, self._mm
        with _register_lock:
            fcntl.lockf(fd, fcntl.LOCK_EX, 1, 0)
            try:
                fields = list(_HEADER.unpack(mm[: _HEADER.size]))
                expected, joined, sealed = fields[8], fields[9], fields[10]
                if sealed or joined >= expected:
                    raise RegionError(self._late_message())
                if self.rank is None:
                    if mm[_SERVICE_OFFSET]:
                        raise RegionError(
                            f"shared region {self.name!r} is already used by another service "
                            f"(creator pid {fields[3]}); give each service its own region "
                            f"name (--region-name or KVCACHE_OFFLOAD_REGION_NAME)"
                        )
                    mm[_SERVICE_OFFSET] = 1
                else:
                    byte, bit = _BITMAP_OFFSET + self.rank // 8, 1 << (self.rank % 8)
                    if mm[byte] & bit:
                        raise RegionError(
                            f"rank {self.rank} already mapped region {self.path}: two workers "
                            f"with one rank"
                        )
                    mm[byte] = mm[byte] | bit
                joined += 1
                fields[9] = joined
                if joined == expected:
                    fields[10] = 1
                mm[: _HEADER.size] = _HEADER.pack(*fields)
                if joined == expected:
                    self._seal()
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, 0)

    def _seal(self) -> None:
        marker = self._bind("sealed")
        if marker is not None:
            self._sockets.append(marker)
        self._unlink_if_ours()
        self.sealed = True
        self._stop_reaper()
        logger.info("region %s is mapped by every worker; its file is unlinked", self.path)

    def _unlink_if_ours(self) -> None:
        """Unlink the path only if it still names the file we have open."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return
        if self._ino is not None and st.st_ino == self._ino:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    # -- pre-faulting ----------------------------------------------------------------------------
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
        free = _free_bytes(self.shm_dir)
        if free < need:
            raise self._populate_error(OSError(errno.ENOSPC, "not enough free space"))
        assert self._np is not None
        for s, e in ranges:
            pages = self._np[s:e:PAGE_SIZE]
            pages[...] = pages.copy()

    def _populate_error(self, exc: OSError) -> RegionError:
        try:
            free = _gib(_free_bytes(self.shm_dir))
        except OSError:
            free = "unknown"
        return RegionError(
            f"pre-faulting this worker's cells of {self.path} failed ({exc}); {self.shm_dir} "
            f"has {free} free for a region of {_gib(self.total_size_bytes)}: enlarge it or "
            f"lower cpu_bytes_to_use"
        )

    # -- views -------------------------------------------------------------------------------------
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

    # -- pinning ---------------------------------------------------------------------------------
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

    # -- info and cleanup ------------------------------------------------------------------------
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

    def _stop_reaper(self) -> None:
        """End the reaper: it unlinks the file only if it is still ours (never a newer one)."""
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            with contextlib.suppress(OSError):
                if reaper.stdin is not None:
                    reaper.stdin.close()
            with contextlib.suppress(Exception):
                reaper.wait(timeout=5)

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
