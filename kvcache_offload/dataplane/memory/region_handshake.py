"""The creator/joiner handshake of a shared region file, and its one-page header.

What it fixes compared with vLLM:

* The *creator* is the process that binds the abstract Unix socket named after the region
  (Linux; released by the kernel when the process dies, SIGKILL included, so it never
  leaks). It checks ``/dev/shm`` free space first (vLLM #46949), removes stale files left
  by a crashed run (there is no live creator, so it is stale: #54002), creates the file with
  ``O_CREAT | O_EXCL``, sizes it and writes the header.
* *Joiners* open the newest file of the region's name (each run has its own:
  :mod:`kvcache_offload.dataplane.memory.region_files`), wait for the header to be ready,
  check that the geometry matches theirs, and register in the header under a ``lockf``
  lock (rank bitmap + counter).
* When the counter reaches the expected number of mappers, whoever completed it unlinks
  the file: every process keeps its mapping, and from then on a SIGKILL of any of them, the
  creator included, leaves nothing in ``/dev/shm`` (vLLM #51579, #54002, #57303). The
  sealer also binds a second abstract name, so a joiner that arrives after the seal gets
  a clear "too late" :class:`RegionError` at once.
* Until the seal, a tiny reaper child (``/bin/sh``) of the creator unlinks the file if the
  creator dies first, SIGKILL included. A second mapper without a rank (a second *service*
  on the same region name) is refused with a :class:`RegionError` rather than sharing the
  blocks.
* Liveness probes ``connect`` to the abstract names instead of binding them, so concurrent
  probes never see each other as the holder.
* Expected mappers: ``num_workers`` when the creator is a worker (has a rank), plus one
  when the creator has no rank (a sidecar service that maps every row); override with
  ``expected_mappers``.

:class:`RegionHandshake` is the base of
:class:`~kvcache_offload.dataplane.memory.shared_offload_region.SharedOffloadRegion`, which
sets the attributes declared here before it calls :meth:`RegionHandshake._open`.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import socket
import struct
import subprocess
import threading
import time
from typing import Any

import numpy as np

from kvcache_offload.dataplane.memory.region_files import run_files, stale_files
from kvcache_offload.dataplane.memory.region_os import (
    bind_name,
    free_bytes,
    gib,
    name_held,
    pid_alive,
    proc_start_time,
    start_reaper,
    stop_reaper,
)
from kvcache_offload.errors import RegionError

__all__ = ["MAX_RANKS", "PAGE_SIZE", "RegionHandshake"]

logger = logging.getLogger("kvcache_offload.dataplane.memory.shared_offload_region")

PAGE_SIZE = mmap.PAGESIZE

_MAGIC = b"KVOFFRG1"
_HEADER = struct.Struct("<8sIIQQQQIIIIQ")
# magic, state, version, creator_pid, creator_start, num_blocks, cpu_page_size,
# num_workers, expected, joined, sealed, data_offset
_SERVICE_OFFSET = 127
"""One header byte: 1 once a mapper without a rank (a service) has joined."""
_BITMAP_OFFSET = 128
MAX_RANKS = (PAGE_SIZE - _BITMAP_OFFSET) * 8
_STATE_READY = 1
_VERSION = 1
_POLL_S = 0.005
_register_lock = threading.Lock()


class RegionHandshake:
    """Create or join the region file, register this mapper, seal once everyone is in."""

    name: str
    num_blocks: int
    cpu_page_size: int
    num_workers: int
    rank: int | None
    shm_dir: str
    path: str
    row_stride: int
    data_offset: int
    total_size_bytes: int
    expected_mappers: int | None
    is_creator: bool
    sealed: bool
    _fd: int | None
    _ino: int | None
    _mm: mmap.mmap | None
    _np: np.ndarray | None
    _sockets: list[socket.socket]
    _reaper: subprocess.Popen[bytes] | None
    _sock_base: str

    def _bind(self, suffix: str) -> socket.socket | None:
        """Bind an abstract Unix socket; None if a live process holds the name."""
        return bind_name(f"{self._sock_base}/{suffix}")

    def _held(self, suffix: str) -> bool:
        """Whether a live process holds the name (probed without taking it)."""
        return name_held(f"{self._sock_base}/{suffix}")

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
                newest = run_files(self.shm_dir, self.name)[:1]
                if not newest:
                    raise FileNotFoundError
                fd = os.open(newest[0], os.O_RDWR)
            except FileNotFoundError:
                if self._held("sealed"):
                    raise RegionError(self._late_message()) from None
                if time.monotonic() > deadline:
                    raise RegionError(
                        f"region {self.name!r} did not appear in {self.shm_dir} within "
                        f"{timeout_s:.0f}s although "
                        f"its creator is alive; if all expected workers already joined, it was "
                        f"unlinked (sealed) and this process is too late"
                    ) from None
                time.sleep(_POLL_S)
                continue
            self.path = newest[0]
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
        for stale in stale_files(self.shm_dir, self.name):
            self._remove_stale(stale)
        try:
            free = free_bytes(self.shm_dir)
        except OSError as exc:
            raise RegionError(f"cannot inspect {self.shm_dir}: {exc}") from exc
        if free < self.total_size_bytes:
            raise RegionError(
                f"{self.shm_dir} has {gib(free)} free but region {self.name!r} needs "
                f"{gib(self.total_size_bytes)} ({self.num_blocks} blocks x "
                f"{self.row_stride} bytes per row for {self.num_workers} workers): lower "
                f"cpu_bytes_to_use, free space in {self.shm_dir}, or enlarge it (e.g. "
                f"docker run --shm-size)"
            )
        expected = self._expected()
        if not 1 <= expected <= MAX_RANKS + 1:
            raise RegionError(f"expected_mappers must be >= 1, got {expected}")
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError as exc:  # pragma: no cover - only a non-participant can race
            raise RegionError(f"{self.path} appeared while creating it: {exc}") from exc
        except OSError as exc:
            raise RegionError(f"cannot create {self.path}: {exc}") from exc
        self._fd = fd
        self._ino = os.fstat(fd).st_ino
        self._reaper = start_reaper(self.path, self._ino)
        try:
            os.ftruncate(fd, self.total_size_bytes)
        except OSError as exc:
            raise RegionError(
                f"cannot size {self.path} to {gib(self.total_size_bytes)}: {exc}"
            ) from exc
        self._map(self.total_size_bytes)
        pid = os.getpid()
        header = _HEADER.pack(
            _MAGIC, 0, _VERSION, pid, proc_start_time(pid), self.num_blocks,
            self.cpu_page_size, self.num_workers, expected, 0, 0, self.data_offset,
        )  # fmt: skip
        assert self._mm is not None
        self._mm[: _HEADER.size] = header
        self._register()
        self._write_state(_STATE_READY)
        logger.info(
            "created shared region %s: %s, %d blocks x %d workers x %d bytes",
            self.path, gib(self.total_size_bytes), self.num_blocks, self.num_workers,
            self.cpu_page_size,
        )  # fmt: skip

    @staticmethod
    def _remove_stale(path: str) -> None:
        """A file of the region exists but no live process holds the creator name: a crashed
        run (its reaper was killed too) or an older version's file."""
        info = ""
        try:
            with open(path, "rb") as f:
                raw = f.read(_HEADER.size)
            if len(raw) == _HEADER.size and raw[:8] == _MAGIC:
                fields = _HEADER.unpack(raw)
                pid, start = fields[3], fields[4]
                alive = pid_alive(pid, start)
                info = f" (creator pid {pid}, {'still running' if alive else 'gone'})"
        except OSError:
            pass
        logger.warning("removing stale region file %s left by a crashed run%s", path, info)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise RegionError(f"cannot remove stale region file {path}: {exc}") from exc

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

    def _stop_reaper(self) -> None:
        reaper, self._reaper = self._reaper, None
        stop_reaper(reaper)
