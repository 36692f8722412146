"""The disk tier's files: their names, and opening them without trusting what is on disk.

Names: a key of up to ``HEX_NAME_MAX_KEY`` bytes is named by its hex digits
(``<key hex>.kvb``); a longer key, whose hex would not fit a file name (255 bytes on common
file systems, with the temporary name's extra characters), is named by the SHA-256 of the key
(``k-<digest hex>.kvb``). Either way the frame header in the file holds the full key, so a read
checks the key exactly and the restart scan learns each file's key from its header.

Opening: a block's name may hold something that is not a block file (a FIFO, a directory, a
symbolic link, left there by hand or by another program). :func:`open_regular` opens without
following links and without blocking (``O_NOFOLLOW | O_NONBLOCK``) and accepts only a regular
file (``fstat``), so such an entry is reported as not a block instead of hanging a worker
thread in ``open()`` or failing a batch.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.tiers import frame

__all__ = [
    "DEVICE_ERRNOS",
    "HEX_NAME_MAX_KEY",
    "PART",
    "SUFFIX",
    "NotABlockFile",
    "block_name",
    "open_regular",
    "read_exactly",
    "read_header",
    "remove_entry",
    "subdir_of",
    "unlink",
    "unlink_all",
]

SUFFIX = ".kvb"
PART = ".part"
HEX_NAME_MAX_KEY = 96
"""Longest key named by its hex digits: 192 + 4 characters, far below 255."""
_HASHED = "k-"
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
DEVICE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})
"""Write errors that say the device, not one block, failed: the tier backs off."""


class NotABlockFile(Exception):
    """A block's name holds something other than a regular file."""


def block_name(key: OffloadKey) -> str:
    """The file name of ``key``'s block (its directory is the name's first two characters)."""
    raw = bytes(key)
    if len(raw) <= HEX_NAME_MAX_KEY:
        return raw.hex() + SUFFIX
    return _HASHED + hashlib.sha256(raw).hexdigest() + SUFFIX


def subdir_of(name: str) -> str:
    """The directory (two hex digits) a block file of this name lives in."""
    return name[len(_HASHED) : len(_HASHED) + 2] if name.startswith(_HASHED) else name[:2]


def open_regular(path: str) -> int | None:
    """A read-only descriptor of the regular file at ``path``; None if nothing is there.

    Raises :class:`NotABlockFile` for a link, FIFO, directory, socket or device."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP (a link), ENXIO (a socket), EACCES, ...
        raise NotABlockFile(path) from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotABlockFile(path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_header(fd: int) -> tuple[int, int, bytes, int] | None:
    """``(digest, payload length, key, header length)`` of the frame at the file's start."""
    fixed = os.read(fd, frame.HEADER_PREFIX)
    if len(fixed) < frame.HEADER_PREFIX:
        return None
    key_len = int.from_bytes(fixed[-2:], "little")
    parsed = frame.decode_header(fixed + os.read(fd, key_len))
    if parsed is None:
        return None
    digest, length, key = parsed
    return digest, length, key, frame.HEADER_PREFIX + key_len


def remove_entry(path: str) -> None:
    """Remove whatever is at ``path`` (a file, link or FIFO; a directory if it is empty)."""
    try:
        os.unlink(path)
    except IsADirectoryError:
        with contextlib.suppress(OSError):
            os.rmdir(path)
    except OSError:
        pass


def read_exactly(fd: int, length: int) -> bytes | None:
    """``length`` bytes from ``fd``'s position, or None if the file ends first.

    A regular file answers in one ``read``; the loop only covers a read cut short by a
    signal (or a file shrunk under us, which then fails as too short).
    """
    data = os.read(fd, length)
    if len(data) == length:
        return data
    parts = [data]
    missing = length - len(data)
    while missing:
        more = os.read(fd, missing)
        if not more:
            return None
        parts.append(more)
        missing -= len(more)
    return b"".join(parts)


def unlink(path: str | Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        pass


def unlink_all(paths: Sequence[Path]) -> None:
    for path in paths:
        unlink(path)
