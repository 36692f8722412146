"""What a shared region asks of the operating system, apart from the mapping itself.

Free space in ``/dev/shm``; whether a process is alive (pid plus start time, so a reused pid
does not count); abstract Unix socket names, which the kernel releases when their holder dies
(SIGKILL included), used as liveness markers; and the reaper child that removes an unsealed
region file once its creator is gone. Linux only, like the region.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import subprocess
from pathlib import Path

from kvcache_offload.errors import RegionError

__all__ = [
    "bind_name",
    "free_bytes",
    "gib",
    "name_held",
    "pid_alive",
    "proc_start_time",
    "start_reaper",
    "stop_reaper",
]

logger = logging.getLogger("kvcache_offload.dataplane.memory.shared_offload_region")

_REAPER_SCRIPT = (
    'cat >/dev/null; i=$(stat -c %i -- "$1" 2>/dev/null) && [ "$i" = "$2" ] && rm -f -- "$1"'
)


def start_reaper(path: str, inode: int) -> subprocess.Popen[bytes] | None:
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


def stop_reaper(reaper: subprocess.Popen[bytes] | None) -> None:
    """End the reaper: it unlinks the file only if it is still ours (never a newer one)."""
    if reaper is not None:
        with contextlib.suppress(OSError):
            if reaper.stdin is not None:
                reaper.stdin.close()
        with contextlib.suppress(Exception):
            reaper.wait(timeout=5)


def proc_start_time(pid: int) -> int:
    """Start time of a process in clock ticks (0 when unknown): guards against pid reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def pid_alive(pid: int, start: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not start or proc_start_time(pid) in (0, start)


def free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return int(st.f_bavail) * int(st.f_frsize)


def gib(n: float) -> str:
    return f"{n / 1024**3:.2f} GiB"


def bind_name(name: str) -> socket.socket | None:
    """Bind the abstract Unix socket ``name``; None if a live process holds it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(f"\0{name}")
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise RegionError(f"cannot bind the region's liveness socket: {exc}") from exc
    return sock


def name_held(name: str) -> bool:
    """Whether a live process holds the abstract name: a ``connect``, which never takes it.

    (Probing by binding it briefly made two concurrent probes see each other as the
    holder: a racing joiner was told "too late", a racing creator became a joiner.)
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.connect(f"\0{name}")
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError as exc:
        raise RegionError(f"cannot probe the region's liveness socket: {exc}") from exc
    finally:
        sock.close()
    return True
