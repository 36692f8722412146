"""TierSet: the ordered secondary tiers, their write queue, back-off and statistics.

The engine talks to this one object, never to a tier directly:

* :meth:`lookup` asks the tiers in order which keys they hold (a key found in one tier is not
  asked of the next), each under a deadline. A tier that fails, times out or is backed off
  answers "miss" and the error is counted: a lookup never fails because of a tier.
* :meth:`get` fetches bytes the same way (first tier that holds a key wins). A value whose
  length is not the block size (``block_nbytes``) fails a check like a bad checksum: it is a
  miss, it is deleted from its tier and it is counted (``corrupt_blocks``), whatever the tier.
* :meth:`offer` queues a write without waiting. The queue is bounded; a full queue drops the
  write and counts it (``writes_dropped``), so a slow tier never holds up the CPU tier or the
  event loop; :meth:`wait_for_room` lets a caller that prefers backpressure wait first. One
  writer task (:meth:`run`, owned by the engine's task group) drains the queue, reading the
  bytes only when it gets to a job and writing each batch to every available tier at once.
* Back-off: a tier that fails is skipped for a while (0.1 s, doubling up to 5 s, reset by a
  success), which is also how a lost connection is retried. A tier whose writes get slow
  (moving average above 1 s) has writes dropped until it is fast again (below 0.5 s), with
  one probe write a second to find out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TypeVar

import anyio

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import TierError
from kvcache_offload.tiers._tier_health import TierHealth as _Health
from kvcache_offload.tiers.base import SecondaryTier, TierStats

__all__ = ["BlockSource", "TierEventSink", "TierSet"]

logger = logging.getLogger(__name__)

BlockSource = Callable[[], Awaitable[Sequence[tuple[OffloadKey, bytes]]]]
"""Called by the writer when it reaches a job: the bytes to write (keys gone since: left out)."""
TierEventSink = Callable[[str, list[OffloadKey], str], None]
"""``(event type "stored" | "evicted", keys, tier name)``."""

_T = TypeVar("_T")


def _contains(tier: SecondaryTier, keys: list[OffloadKey]) -> Awaitable[list[bool]]:
    return tier.contains(keys)


class TierSet:
    """Ordered secondary tiers behind one non-blocking interface; see the module docstring."""

    def __init__(
        self,
        tiers: Sequence[SecondaryTier],
        *,
        queue_size: int = 256,
        read_timeout_s: float = 0.5,
        write_timeout_s: float = 30.0,
        on_event: TierEventSink | None = None,
        block_nbytes: int | None = None,
    ) -> None:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise TierError(f"tier names must be unique, got {names}")
        self.tiers = list(tiers)
        self.queue_size = queue_size
        self.read_timeout_s = read_timeout_s
        self.write_timeout_s = write_timeout_s
        self._on_event = on_event
        self.block_nbytes = block_nbytes
        """Every value's length (None: not checked)."""
        self._room: deque[asyncio.Future[None]] = deque()
        """Callers of :meth:`wait_for_room`, woken in turn as the writer takes jobs."""
        self._health = {t.name: _Health() for t in self.tiers}
        self._queue: deque[tuple[int, BlockSource, Callable[[], None] | None]] = deque()
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._writing = False
        self._opened = False
        self._open_done = asyncio.Event()
        """Set once every tier's open returned: a caller that finds the open under way waits."""
        self.writes_queued = 0
        self.queue_full_blocks = 0
        """Blocks refused by :meth:`offer` because the queue was full."""

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tiers]

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    async def open(self) -> None:
        """Open every tier (a tier that cannot open is backed off, not fatal). Concurrent
        callers share one open and all return once it is done: a lookup racing the engine's
        start must not ask a tier whose open (the object tier's listing) is still running."""
        if self._opened:
            await self._open_done.wait()
            return
        self._opened = True
        try:
            for tier in self.tiers:
                try:
                    await tier.open()
                except TierError as exc:
                    logger.warning("tier %s did not open: %s", tier.name, exc)
                    self._health[tier.name].failed(time.monotonic())
        finally:
            self._open_done.set()

    # -- reads -------------------------------------------------------------------------------

    async def _ask(
        self,
        tier: SecondaryTier,
        call: Callable[[SecondaryTier, list[OffloadKey]], Awaitable[Sequence[_T | None]]],
        keys: list[OffloadKey],
    ) -> Sequence[_T | None] | None:
        """One read call under the deadline; None when the tier is down, failed or slow."""
        health = self._health[tier.name]
        if not health.available(time.monotonic()):
            return None
        try:
            # asyncio.timeout: a fraction of anyio.fail_after's cost on this hot path.
            async with asyncio.timeout(tier.read_timeout_s or self.read_timeout_s):
                answer = await call(tier, keys)
        except (TierError, TimeoutError) as exc:
            logger.debug("tier %s read failed: %r", tier.name, exc)
            health.failed(time.monotonic())
            return None
        health.succeeded()
        return answer

    async def _first_tier(
        self,
        keys: Sequence[OffloadKey],
        call: Callable[[SecondaryTier, list[OffloadKey]], Awaitable[Sequence[_T | None]]],
        *,
        count: bool,
    ) -> dict[OffloadKey, tuple[_T, str]]:
        """Each key's answer from the first tier that has one (None or False: ask the next).

        A tier that is down or fails passes all its keys on. With ``count``, every key asked
        of a tier is one hit or one miss of that tier.
        """
        out: dict[OffloadKey, tuple[_T, str]] = {}
        remaining = list(dict.fromkeys(keys))
        for tier in self.tiers:
            if not remaining:
                break
            asked = remaining
            answer = await self._ask(tier, call, asked)
            if answer is not None:
                remaining = []
                for key, value in zip(asked, answer, strict=True):
                    if value is None or value is False:
                        remaining.append(key)
                    else:
                        out[key] = (value, tier.name)
            if count:
                counts = self._health[tier.name].counts
                counts.hits += len(asked) - len(remaining)
                counts.misses += len(remaining)
        return out

    async def lookup(self, keys: Sequence[OffloadKey]) -> dict[OffloadKey, str]:
        """For each key some tier holds, the first such tier's name."""
        found = await self._first_tier(keys, _contains, count=True)
        return {key: name for key, (_, name) in found.items()}

    async def get(self, keys: Sequence[OffloadKey]) -> dict[OffloadKey, tuple[bytes, str]]:
        """Bytes and tier name of each key some tier could deliver (verified)."""
        return await self._first_tier(keys, self._get_sized, count=False)

    async def _get_sized(
        self, tier: SecondaryTier, keys: list[OffloadKey]
    ) -> Sequence[bytes | None]:
        """``tier.get``, with a value of the wrong length a miss, deleted and counted."""
        values = await tier.get(keys)
        size = self.block_nbytes
        if size is None:
            return values
        bad = [k for k, v in zip(keys, values, strict=True) if v is not None and len(v) != size]
        if not bad:
            return values
        self._health[tier.name].counts.corrupt_blocks += len(bad)
        logger.warning("tier %s held %d blocks of the wrong length; deleted", tier.name, len(bad))
        try:
            await tier.delete(bad)
        except TierError as exc:  # still a miss; found again and deleted on a later read
            logger.debug("deleting bad blocks from tier %s failed: %r", tier.name, exc)
        return [None if v is not None and len(v) != size else v for v in values]

    # -- writes ------------------------------------------------------------------------------

    def offer(
        self,
        num_blocks: int,
        source: BlockSource,
        done: Callable[[], None] | None = None,
        *,
        limit: int | None = None,
    ) -> bool:
        """Queue a write of ``num_blocks`` blocks; False (and counted) when the queue is full.

        ``done`` runs on the loop once the write ended, landed or not (not when refused).
        ``limit``: jobs the queue may hold for this offer (default ``queue_size``)."""
        if num_blocks <= 0:
            return True
        if len(self._queue) >= (self.queue_size if limit is None else limit):
            for health in self._health.values():
                health.counts.writes_dropped += num_blocks
            self.queue_full_blocks += num_blocks
            return False
        self._queue.append((num_blocks, source, done))
        self.writes_queued += num_blocks
        self._idle.clear()
        self._wakeup.set()
        return True

    @property
    def full(self) -> bool:
        return len(self._queue) >= self.queue_size

    async def wait_for_room(self, timeout_s: float) -> bool:
        """Wait until the queue has room for one more job (at most ``timeout_s``); True when it
        has. With no await between this and :meth:`offer`, the offer is then accepted."""
        if not self.full:
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.full:
            left = deadline - loop.time()
            if left <= 0:
                return False
            waiter = loop.create_future()
            self._room.append(waiter)
            try:
                async with asyncio.timeout(left):
                    await waiter
            except TimeoutError:
                return not self.full
            finally:
                if not waiter.done():
                    waiter.cancel()
        return True

    def _wake_one(self) -> None:
        while self._room:
            waiter = self._room.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def run(self) -> None:
        """The writer: drains the queue until cancelled (owned by the engine's task group)."""
        while True:
            if not self._queue:
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            num_blocks, source, done = self._queue.popleft()
            self._wake_one()
            self._writing = True
            try:
                await self._write_job(num_blocks, source)
            except Exception:
                logger.exception("a tier write job failed; dropped")
            finally:
                self._writing = False
                if done is not None:
                    done()

    async def _write_job(self, num_blocks: int, source: BlockSource) -> None:
        now = time.monotonic()
        targets = []
        for tier in self.tiers:
            if self._health[tier.name].accepts_write(now):
                targets.append(tier)
            else:
                self._health[tier.name].counts.writes_dropped += num_blocks
        if not targets:
            return
        items = list(await source())
        if not items:
            return
        async with anyio.create_task_group() as tg:
            for tier in targets:
                tg.start_soon(self._put, tier, items)

    async def _put(self, tier: SecondaryTier, items: list[tuple[OffloadKey, bytes]]) -> None:
        health = self._health[tier.name]
        start = time.monotonic()
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await tier.put(items)
        except (TierError, TimeoutError) as exc:
            logger.debug("tier %s write failed: %r", tier.name, exc)
            health.failed(time.monotonic())
            health.counts.writes_dropped += len(items)
            return
        health.succeeded()
        health.wrote(time.monotonic() - start)
        if self._on_event is not None:
            evicted = tier.take_evicted()
            if evicted:
                self._on_event("evicted", evicted, tier.name)
            self._on_event("stored", [k for k, _ in items], tier.name)

    async def drain(self, timeout_s: float) -> bool:
        """Wait until the queue is empty and no write runs (the writer must be running)."""
        with anyio.move_on_after(timeout_s):
            while self._queue or self._writing:
                await self._idle.wait()
                if self._queue or self._writing:
                    await anyio.sleep(0)  # woken before the last job finished: look again
            return True
        return False

    # -- bookkeeping -------------------------------------------------------------------------

    def stats(self) -> list[TierStats]:
        now = time.monotonic()
        out = []
        for tier in self.tiers:
            health = self._health[tier.name]
            c = health.counts
            own = tier.stats()
            out.append(
                replace(
                    own,
                    available=health.available(now) and not health.slow,
                    hits=c.hits,
                    misses=c.misses,
                    errors=c.errors,
                    # The tier's own counts (blocks one write or read rejected) plus the set's.
                    writes_dropped=c.writes_dropped + own.writes_dropped,
                    corrupt_blocks=c.corrupt_blocks + own.corrupt_blocks,
                )
            )
        return out

    async def aclose(self) -> None:
        self._queue.clear()
        while self._room:
            self._wake_one()
        for tier in self.tiers:
            try:
                await tier.aclose()
            except Exception:
                logger.exception("closing tier %s failed", tier.name)
