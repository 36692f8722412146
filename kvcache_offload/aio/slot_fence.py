"""Slot fences: no slot changes owner while someone may still copy bytes into or out of it.

Two kinds of copier outlive the manager state that gave them their slot:

* this process's own block copies (``write_blocks``/``read_block`` run in worker threads):
  :class:`BlockCopies` counts them so that a reset waits until every one has finished before
  slots are handed out again;
* sidecar clients of the shared region, which copy with plain memory writes that the service
  cannot revoke. When their lease expires (or a reset takes it), the lease's slots go into
  :class:`SlotQuarantine` for a grace period: a store lease's slots are *fenced* (its keys are
  gone, the slots belong to nobody and are not reused), a load lease's blocks stay pinned.
  Only after the grace period do the slots become free again. A sidecar client must not touch
  a slot after its lease's ``expires_at``; the grace period is how late it may be without
  ever corrupting another key's block.

All methods run on the event-loop thread.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import anyio

from kvcache_offload.contracts.manager import ReqContext
from kvcache_offload.contracts.offload_key import OffloadKey

__all__ = ["BlockCopies", "QuarantinedSlots", "SlotQuarantine"]


class BlockCopies:
    """How many block copies run in threads now, and a way to wait until there are none."""

    def __init__(self) -> None:
        self._running = 0
        self._idle: anyio.Event | None = None

    @property
    def running(self) -> int:
        return self._running

    @contextmanager
    def copying(self) -> Iterator[None]:
        """Count one copy for the duration of the block (enter it before the first await)."""
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1
            if self._running == 0 and self._idle is not None:
                self._idle.set()
                self._idle = None

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no copy runs (immediately when none does); False after ``timeout_s``."""
        if self._running == 0:
            return True
        if self._idle is None:
            self._idle = anyio.Event()
        idle = self._idle
        with anyio.move_on_after(timeout_s):
            await idle.wait()
            return True
        return False


@dataclass(order=True)
class QuarantinedSlots:
    """Slots out of use until ``release_at`` (``time.monotonic()``)."""

    release_at: float
    order: int
    block_ids: list[int] = field(compare=False, default_factory=list)
    """Fenced slots: their keys are gone; released to the free list."""
    pinned_keys: list[OffloadKey] = field(compare=False, default_factory=list)
    """Blocks of an expired load lease: still ready and cached, pinned until the release."""
    req_context: ReqContext = field(compare=False, default_factory=ReqContext)


class SlotQuarantine:
    """Quarantined slots by release time; the engine releases the due ones lazily."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.pending: list[QuarantinedSlots] = []
        """The quarantined slots, a heap by release time (empty: nothing is ever due, which
        the engine checks before every store without a call)."""
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self.pending)

    def fence(self, block_ids: list[int]) -> None:
        if block_ids:
            self._push(QuarantinedSlots(0.0, 0, block_ids=block_ids))

    def pin(self, keys: list[OffloadKey], req_context: ReqContext) -> None:
        if keys:
            self._push(QuarantinedSlots(0.0, 0, pinned_keys=keys, req_context=req_context))

    def _push(self, item: QuarantinedSlots) -> None:
        item.release_at = time.monotonic() + self.grace_s
        item.order = next(self._order)
        heapq.heappush(self.pending, item)

    def due(self) -> list[QuarantinedSlots]:
        """Remove and return the entries whose grace period is over."""
        heap = self.pending
        if not heap or heap[0].release_at > time.monotonic():
            return []
        now = time.monotonic()
        out = []
        while heap and heap[0].release_at <= now:
            out.append(heapq.heappop(heap))
        return out

    def take_pinned(self) -> list[QuarantinedSlots]:
        """Remove and return the pinned entries (a reset fences their blocks instead)."""
        pinned = [item for item in self.pending if item.pinned_keys]
        if pinned:
            self.pending = [item for item in self.pending if not item.pinned_keys]
            heapq.heapify(self.pending)
        return pinned
