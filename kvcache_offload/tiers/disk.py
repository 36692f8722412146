"""DiskTier: blocks as files in one directory, with a byte budget and its own LRU eviction.

Layout: ``<path>/<fingerprint>/<two hex digits>/<name>.kvb``, each file one frame
(:mod:`kvcache_offload.tiers.frame`: header with the full key, then the block's bytes); a key
of any length has a name (:mod:`~kvcache_offload.tiers._disk_files`: hex digits, or a hash for
a long key). A write goes to a ``.part`` file that is fsynced and then renamed into place, so a
crash leaves either the old state or a complete file, never a torn one under a block's name; a
write that fails removes its ``.part`` file, and stale ones are removed on open. A block that
fails one write is dropped and counted (``writes_dropped``) while the rest of its batch lands;
only an error of the device (full, read-only, I/O error) fails the batch, so that the tier
backs off. A file that fails its checks (truncated or edited by hand, bit rot, not a regular
file) is a miss, is removed and is counted (``corrupt_blocks``); files are opened without
following links or blocking, so a FIFO or directory under a block's name never hangs a read.

The index (key -> file size, in LRU order) lives in memory, rebuilt by scanning the directory
on :meth:`open`, so the contents survive a restart and ``contains`` costs no I/O. Every file
operation runs in a worker thread; the index is only touched on the event loop.
"""

from __future__ import annotations

import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import anyio

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import ConfigError, TierError
from kvcache_offload.tiers import _disk_files as files
from kvcache_offload.tiers import frame
from kvcache_offload.tiers._cpus import SPARE_CORE_CPUS, usable_cpus
from kvcache_offload.tiers._disk_files import read_exactly as _read_exactly
from kvcache_offload.tiers._disk_files import unlink as _unlink
from kvcache_offload.tiers._disk_files import unlink_all as _unlink_all
from kvcache_offload.tiers._fresh_blocks import fresh_blocks
from kvcache_offload.tiers._overlapped_checks import OverlappedChecks
from kvcache_offload.tiers.base import LatencyHistogram, SecondaryTier, TierStats

__all__ = ["DiskTier"]

_SUFFIX = files.SUFFIX
_PART = files.PART


class DiskTier(SecondaryTier):
    """A local directory holding at most ``capacity_bytes`` of block files."""

    def __init__(
        self,
        path: str | Path,
        capacity_bytes: int,
        fingerprint: str,
        *,
        check_thread: bool | None = None,
    ) -> None:
        """``check_thread``: verify a batch's blocks on a second thread while the next is read
        (:mod:`~kvcache_offload.tiers._overlapped_checks`). By default only where the process
        may run on at least four CPUs: on two busy vCPUs the check thread found no idle core,
        and verifying on the reading thread was faster (0.72-0.74x of a plain read vs
        0.63-0.68x)."""
        if capacity_bytes <= 0:
            raise ConfigError(f"disk_bytes must be > 0, got {capacity_bytes}")
        self.name = "disk"
        self.root = Path(path) / fingerprint
        self._root = str(self.root)
        self.capacity_bytes = int(capacity_bytes)
        self._index: OrderedDict[OffloadKey, int] = OrderedDict()
        self._used = 0
        self._evicted: list[OffloadKey] = []
        self._subdirs: set[Path] = set()
        self._opened = False
        self._stats = TierStats(self.name, "disk", capacity_bytes=self.capacity_bytes)
        self._hist = {op: LatencyHistogram() for op in ("get", "put", "delete")}
        self._checks = OverlappedChecks(self.name)
        self.check_thread = (
            usable_cpus() >= SPARE_CORE_CPUS if check_thread is None else check_thread
        )

    # -- files -------------------------------------------------------------------------------

    def _file(self, key: OffloadKey) -> Path:
        return Path(self._path(key))

    def _path(self, key: OffloadKey) -> str:
        # A string, not a Path: joining Paths cost ~10 us a block on the read path.
        name = files.block_name(key)
        return f"{self._root}/{files.subdir_of(name)}/{name}"

    def _scan(self) -> list[tuple[OffloadKey, int, float]]:
        """Every complete block file with its size and mtime; partial or torn files go.

        Only each file's header is read: a file whose length disagrees with the length its
        header declares (truncated, or a crash before the rename) is removed here, so it is
        never reported as held. Flipped bits are caught by the checksum when it is read.
        """
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TierError(f"cannot create disk tier directory {self.root}: {exc}") from exc
        found: list[tuple[OffloadKey, int, float]] = []
        for sub in self.root.iterdir():
            if not sub.is_dir() or sub.is_symlink():
                continue
            for entry in os.scandir(sub):
                if entry.name.endswith(_PART):
                    files.remove_entry(entry.path)
                    continue
                if not entry.name.endswith(_SUFFIX):
                    continue
                block = self._scan_one(entry.path, sub.name, entry.name)
                if block is None:
                    files.remove_entry(entry.path)
                    self._stats.corrupt_blocks += 1
                elif block is not _GONE:
                    found.append(block)  # type: ignore[arg-type]
        found.sort(key=lambda item: item[2])  # oldest first: LRU order survives a restart
        return found

    def _scan_one(self, path: str, sub: str, name: str) -> tuple[OffloadKey, int, float] | object:
        """``(key, size, mtime)`` of a complete block file; None if it must go; ``_GONE``."""
        try:
            fd = files.open_regular(path)
        except files.NotABlockFile:
            return None
        if fd is None:
            return _GONE
        try:
            st = os.fstat(fd)
            header = files.read_header(fd)
        except OSError:
            return None
        finally:
            os.close(fd)
        if header is None:
            return None
        _digest, length, raw, head_len = header
        key = OffloadKey(raw)
        if files.block_name(key) != name or files.subdir_of(name) != sub:
            return None  # not where this key's block lives: never found by a read
        if st.st_size != head_len + length:
            return None
        return key, st.st_size, st.st_mtime

    def _write(self, key: OffloadKey, payload: bytes) -> int:
        header = frame.encode_header(key, payload)
        final = self._file(key)
        if final.parent not in self._subdirs:
            final.parent.mkdir(parents=True, exist_ok=True)
            self._subdirs.add(final.parent)
        # A short name of its own: a long key's name plus a suffix would pass 255 characters.
        part = final.parent / f".{uuid.uuid4().hex}{_PART}"
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            try:
                written = os.writev(fd, [header, payload])  # one syscall for header and block
                if written < len(header) + len(payload):  # rare short write: finish it
                    rest = memoryview(header + payload)[written:]
                    while rest:
                        rest = rest[os.write(fd, rest) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(part, final)
        except BaseException:
            _unlink(part)
            raise
        return len(header) + len(payload)

    def _read(self, key: OffloadKey) -> tuple[str, bytes, bytes] | None:
        """The file's path, header and payload, unverified; None when the file is gone.

        Three syscalls and one copy: ``fstat`` (the file's length must be exactly header +
        declared payload: a truncated or extended file fails here, before any payload is
        read), the header, then the payload straight into the bytes object that is returned
        (unbuffered, so no read-ahead buffer sits between). A file that fails here is removed
        and raises :class:`_Corrupt`; the checksum is :func:`_verified`'s.
        """
        path = self._path(key)
        try:
            fd = files.open_regular(path)
        except files.NotABlockFile:
            files.remove_entry(path)
            raise _Corrupt from None
        if fd is None:
            return None
        try:
            size = os.fstat(fd).st_size
            head_len = frame.HEADER_PREFIX + len(key)
            header = os.read(fd, head_len)
            parsed = frame.decode_header(header)
            payload = None
            if parsed is not None and size == head_len + parsed[1]:
                payload = _read_exactly(fd, parsed[1])
        finally:
            os.close(fd)
        if payload is None:
            _unlink(path)
            raise _Corrupt
        return path, header, payload

    # -- contract ----------------------------------------------------------------------------

    async def open(self) -> None:
        if self._opened:
            return
        found = await anyio.to_thread.run_sync(self._scan)
        for key, size, _mtime in found:
            self._index[key] = size
            self._used += size
        self._opened = True
        await self._evict_over_budget(0)

    async def contains(self, keys: Sequence[OffloadKey]) -> list[bool]:
        index = self._index
        return [key in index for key in keys]

    async def get(self, keys: Sequence[OffloadKey]) -> list[bytes | None]:
        """Reads the held keys of the batch in one worker-thread call."""
        held = [k for k in dict.fromkeys(keys) if k in self._index]
        if not held:
            return [None] * len(keys)
        start = time.perf_counter()
        try:
            found = await anyio.to_thread.run_sync(self._read_all, held)
        except OSError as exc:
            self._stats.errors += 1
            raise TierError(f"reading blocks from {self.root}: {exc}") from exc
        self._hist["get"].observe(time.perf_counter() - start)
        by_key: dict[OffloadKey, bytes] = {}
        for key, data in zip(held, found, strict=True):
            if not isinstance(data, bytes):  # gone meanwhile, or corrupt (and removed)
                if data is _CORRUPT:
                    self._stats.corrupt_blocks += 1
                self._forget(key)
                continue
            by_key[key] = data
            self._index.move_to_end(key)
            self._stats.get_blocks += 1
            self._stats.get_bytes += len(data)
        return [by_key.get(k) for k in keys]

    def _read_all(self, keys: list[OffloadKey]) -> list[bytes | object | None]:
        """Each key's verified payload, None (gone) or ``_CORRUPT`` (removed).

        Each payload's checksum runs on the check thread while the next file is read (the
        last one's here): :mod:`kvcache_offload.tiers._overlapped_checks` says why.
        """
        out: list[bytes | object | None] = [None] * len(keys)
        checks = {}
        for i, key in enumerate(keys):
            try:
                found = self._read(key)
            except (_Corrupt, OSError):  # one block's failure is that block's miss
                out[i] = _CORRUPT
                continue
            if found is not None:
                last = i == len(keys) - 1 or not self.check_thread
                checks[i] = self._checks.start(_verified, key, *found, last=last)
        for i, check in checks.items():
            out[i] = check.result()
        return out

    async def put(self, items: Sequence[tuple[OffloadKey, bytes]]) -> None:
        """Writes the new blocks of the batch in one worker-thread call (each fsynced)."""
        fresh, incoming = fresh_blocks(items, self._index, self._index.move_to_end)
        if not fresh:
            return
        await self._evict_over_budget(incoming)
        start = time.perf_counter()
        landed: list[tuple[OffloadKey, int]] = []
        try:
            failed = await anyio.to_thread.run_sync(self._write_all, list(fresh.items()), landed)
        finally:  # what landed is indexed (and in the budget) whatever happens to this call
            for key, size in landed:
                old = self._index.pop(key, None)  # a racing put of the same key
                if old is not None:
                    self._used -= old
                self._index[key] = size
                self._used += size
                self._stats.put_blocks += 1
                self._stats.put_bytes += len(fresh[key])
        self._hist["put"].observe(time.perf_counter() - start)
        self._stats.writes_dropped += len(fresh) - len(landed)
        await self._evict_over_budget(0)
        if failed is not None:
            self._stats.errors += 1
            raise TierError(f"writing blocks to {self.root}: {failed}") from failed

    def _write_all(
        self, items: list[tuple[OffloadKey, bytes]], landed: list[tuple[OffloadKey, int]]
    ) -> OSError | None:
        """Write each block, appending what landed to ``landed``; a block that fails is
        skipped (its ``.part`` file removed). Returns the device error that stopped the
        batch (disk full, read-only, I/O error), else None."""
        for key, payload in items:
            try:
                landed.append((key, self._write(key, payload)))
            except OSError as exc:
                if exc.errno in files.DEVICE_ERRNOS:
                    return exc
        return None

    async def delete(self, keys: Sequence[OffloadKey]) -> None:
        paths = [self._file(k) for k in keys if self._forget(k)]
        if paths:
            start = time.perf_counter()
            await anyio.to_thread.run_sync(_unlink_all, paths)
            self._hist["delete"].observe(time.perf_counter() - start)
            self._stats.deleted_blocks += len(paths)

    def stats(self) -> TierStats:
        s = self._stats
        return TierStats(
            **{
                **s.__dict__,
                "blocks": len(self._index),
                "bytes": self._used,
                "op_seconds": {op: h.copy() for op, h in self._hist.items()},
            }
        )

    async def aclose(self) -> None:
        await anyio.to_thread.run_sync(self._checks.close)

    # -- eviction ----------------------------------------------------------------------------

    def _forget(self, key: OffloadKey) -> bool:
        size = self._index.pop(key, None)
        if size is None:
            return False
        self._used -= size
        return True

    def take_evicted(self) -> list[OffloadKey]:
        evicted, self._evicted = self._evicted, []
        return evicted

    async def _evict_over_budget(self, incoming: int) -> None:
        """Drop least recently used files until ``incoming`` more bytes fit the budget."""
        victims: list[OffloadKey] = []
        while self._index and self._used + incoming > self.capacity_bytes:
            key, size = self._index.popitem(last=False)
            self._used -= size
            victims.append(key)
        if victims:
            self._stats.evicted_blocks += len(victims)
            self._evicted.extend(victims)
            # The index forgot them first, so no reader goes looking while they are unlinked.
            await anyio.to_thread.run_sync(_unlink_all, [self._file(k) for k in victims])


class _Corrupt(Exception):
    """A block file failed its frame checks (it has been removed)."""


_CORRUPT = object()
"""What :meth:`DiskTier._read_all` reports for a corrupt file."""
_GONE = object()
"""What :meth:`DiskTier._scan_one` reports for a file removed while the scan ran."""


def _verified(key: OffloadKey, path: str, header: bytes, payload: bytes) -> bytes | object:
    """``payload`` if its frame checks out, else ``_CORRUPT`` (and the file is removed)."""
    if frame.verify(key, header, payload):
        return payload
    _unlink(path)
    return _CORRUPT
