"""BlockReserve: block-sized buffers whose pages are already mapped, for copies on the loop.

When the tier writer lags, an evicting store copies its victims' bytes out on the event loop
before it reuses their CPU slots (:meth:`EngineTiers._save_victims`). Those copies stay queued
until the writer reaches them, so each one needs fresh memory, and writing into fresh memory
pays a page fault per 4 KiB page: on a 2-vCPU VM 4 MiB of victims took ~2.5 ms that way
against ~0.45 ms into mapped pages. The reserve hands out buffers touched ahead of time in a
worker thread, and touches more after each hand-out, so the faults are paid off the loop. An
empty reserve hands out a fresh buffer: never a wait. It holds at most ``target`` buffers
(8: 16 MiB at 2 MiB blocks), and only once a victims' copy was needed.
"""

from __future__ import annotations

import asyncio
import contextlib

import anyio
import numpy as np

__all__ = ["BlockReserve"]


def _mapped(nbytes: int, count: int) -> list[np.ndarray]:
    """``count`` writable buffers of ``nbytes`` whose pages are mapped (a worker thread).

    Touched by numpy (which drops the GIL for the copy), one page fault at a time: a
    ``MAP_POPULATE`` mapping would hold the process's memory-map lock for the whole buffer
    and stall every other thread's page faults meanwhile."""
    out = []
    for _ in range(count):
        buf = np.empty(nbytes, np.uint8)
        np.copyto(buf, 0)
        out.append(buf)
    return out


class BlockReserve:
    """Up to ``target`` mapped buffers of one size; see the module docstring."""

    def __init__(self, target: int = 8) -> None:
        self.target = target
        self._free: list[np.ndarray] = []
        self._nbytes = 0
        self._filling: asyncio.Task[None] | None = None

    def take(self, nbytes: int) -> np.ndarray:
        """A writable buffer of ``nbytes``: a mapped one if the reserve has one."""
        if nbytes != self._nbytes:
            self._free.clear()
            self._nbytes = nbytes
        if self._free:
            return self._free.pop()
        return np.empty(nbytes, np.uint8)

    def refill(self) -> None:
        """Map buffers up to ``target`` in a worker thread (on the loop; returns at once)."""
        if len(self._free) >= self.target or self._nbytes == 0:
            return
        if self._filling is None or self._filling.done():
            self._filling = asyncio.get_running_loop().create_task(self._fill())

    async def _fill(self) -> None:
        nbytes = self._nbytes
        mapped = await anyio.to_thread.run_sync(_mapped, nbytes, self.target - len(self._free))
        if nbytes == self._nbytes:
            self._free.extend(mapped[: max(0, self.target - len(self._free))])

    async def aclose(self) -> None:
        task, self._filling = self._filling, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._free.clear()
