"""Whether a CPU tier of the configured size can exist on this host, checked before serving.

Block memory is mapped lazily (pages arrive on first write), so an impossible size would
otherwise start fine and fail at the first store, or get the process OOM-killed later. A
tier must hold at least one block, and its bytes must fit in the memory the kernel reports
as available (``MemAvailable``), and, for a shared region, in the free space of ``/dev/shm``.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvcache_offload.errors import ConfigError

__all__ = ["available_memory_bytes", "check_cpu_tier", "format_bytes"]


def format_bytes(n: float) -> str:
    """``2.00 MiB``-style text (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """``MemAvailable`` in bytes, or None where the kernel does not say (not Linux)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_cpu_tier(
    num_blocks: int,
    block_nbytes: int,
    cpu_bytes_to_use: int,
    *,
    shm_dir: str | None = None,
    available: int | None = None,
) -> None:
    """Raise :class:`ConfigError` (one line) unless the tier holds a block and fits the host.

    ``shm_dir`` is the directory of a shared region, whose free space must hold it too.
    """
    if num_blocks <= 0:
        raise ConfigError(
            f"cpu_bytes_to_use {format_bytes(cpu_bytes_to_use)} holds no block: one offloaded "
            f"block is {format_bytes(block_nbytes)}; use at least that much (e.g. --cpu-bytes 4GiB)"
        )
    needed = num_blocks * block_nbytes
    if available is None:
        available = available_memory_bytes()
    if available is not None and needed > available:
        raise ConfigError(
            f"the CPU tier needs {format_bytes(needed)} ({num_blocks} blocks of "
            f"{format_bytes(block_nbytes)}) but this host has only {format_bytes(available)} "
            f"of memory available: lower --cpu-bytes"
        )
    if shm_dir is not None and os.path.isdir(shm_dir):
        st = os.statvfs(shm_dir)
        free = int(st.f_bavail) * int(st.f_frsize)
        if needed > free:
            raise ConfigError(
                f"the shared region needs {format_bytes(needed)} but {shm_dir} has only "
                f"{format_bytes(free)} free: lower --cpu-bytes or enlarge {shm_dir} "
                f"(e.g. docker run --shm-size)"
            )
