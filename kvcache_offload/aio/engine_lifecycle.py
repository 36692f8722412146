"""The engine's lifecycle: start, the background runner, reset and close.

One background runner task owns an anyio task group with the transfer poller, the lease
reaper, the KV-event publisher and the tier writer; it starts on ``async with`` (or on the
first operation that needs it) and ends in :meth:`Lifecycle.aclose`, which also finishes or
fails in-flight jobs, rolls open leases back and releases every resource the engine holds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Self

import anyio

from kvcache_offload.aio.engine_block_bytes import BlockBytes
from kvcache_offload.aio.types import EventType
from kvcache_offload.contracts.capabilities import ShutsDown
from kvcache_offload.errors import TransferError

__all__ = ["Lifecycle"]

logger = logging.getLogger("kvcache_offload.aio.engine")


class Lifecycle(BlockBytes):
    """``start``/``aclose`` (and ``async with``), the background runner and ``reset``."""

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start the background tasks and, for a shared region, set the region up off-loop."""
        self._check_open()
        self._ensure_started()
        if self.config.shared_region and self._block_memory is None:
            await self._get_block_memory()
        if self._tiers is not None:
            await self._tiers.open()
        if self.config.transfer.gc_freeze:
            self._heap_freeze.freeze()

    def _ensure_started(self) -> None:
        if self._runner is None and not self._closed:
            self._stop = asyncio.Event()
            self._runner = asyncio.get_running_loop().create_task(
                self._run_background(self._stop), name="kvcache-offload-engine"
            )

    async def _run_background(self, stop: asyncio.Event) -> None:
        try:
            async with anyio.create_task_group() as tg:
                if self._poller is not None:
                    tg.start_soon(self._poller.run, name="kvcache-offload-poller")
                tg.start_soon(self._leases.run, name="kvcache-offload-lease-reaper")
                if self._kv_events is not None:
                    tg.start_soon(self._kv_events.run, name="kvcache-offload-kv-events")
                if self._tiers is not None:
                    tg.start_soon(self._tiers.run, name="kvcache-offload-tier-writer")
                await stop.wait()
                tg.cancel_scope.cancel()
        except Exception:
            logger.exception("engine background task failed")
            raise

    async def aclose(self) -> None:
        """Finish or fail in-flight jobs, roll back leases, stop tasks, release everything.

        Idempotent and shielded from cancellation, so it also cleans up after errors.
        """
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            poller = self._poller
            if poller is not None and poller.in_flight:
                drained = False
                if self._runner is not None and not self._runner.done():
                    drained = await poller.drain(self.close_timeout_s)
                if not drained:
                    n = poller.fail_all("the engine closed before the transfer finished")
                    logger.warning("closed with %d transfers still in flight", n)
            for lease in self._leases.take_all():
                self._rollback_lease(lease)
            if self._tiers is not None:  # queued tier writes finish while the writer runs
                await self._tiers.aclose(self.close_timeout_s if self._runner else 0.0)
            if self._runner is not None and self._stop is not None:
                self._stop.set()
                try:
                    await self._runner
                except BaseException:
                    logger.debug("background task ended with an error", exc_info=True)
            self._hub.close()
            if self._kv_events is not None:
                try:
                    await self._kv_events.aclose()
                except Exception:
                    logger.exception("closing the KV-event publisher failed")
            if self._worker is not None:
                try:
                    await anyio.to_thread.run_sync(self._worker.shutdown)
                except Exception:
                    logger.exception("shutting the worker down failed")
            if self._block_memory is not None:
                self._guard(self._block_memory.close, "closing block memory")
            self._guard(self.manager.shutdown, "shutting the manager down")
            if isinstance(self.spec, ShutsDown):  # handlers, memory, region (file work)
                try:
                    await anyio.to_thread.run_sync(self.spec.shutdown)
                except Exception:
                    logger.exception("shutting the spec down failed")
            self._heap_freeze.release()

    @staticmethod
    def _guard(fn: Callable[[], object], what: str) -> None:
        try:
            fn()
        except Exception:
            logger.exception("%s failed", what)

    async def reset(self) -> None:
        """Drop every offloaded block once in-flight jobs and block copies finished.

        Open leases roll back; their slots (which sidecar clients may still be copying) stay
        fenced for the grace period, so a late copy never lands in a block of another key.
        """
        self._check_open()
        poller = self._poller
        copies = self._copies
        while (poller is not None and poller.in_flight) or copies.running:
            if poller is not None and poller.in_flight:
                self._ensure_started()
                if not await poller.drain(self.close_timeout_s):
                    raise TransferError("reset gave up waiting for in-flight transfers")
            if not await copies.wait_idle(self.close_timeout_s):
                raise TransferError("reset gave up waiting for in-flight block copies")
        # From here on everything is synchronous: no job, copy or lease can sneak in.
        fences = self._fences
        leases = self._leases.take_all()
        if fences is not None and self._quarantine.grace_s > 0:
            fenced: list[int] = []
            for lease in leases:
                fenced += fences.fence(lease.keys)
                if lease.kind == "store":
                    self._totals.store_blocks_failed += len(lease.keys)
            for item in self._quarantine.take_pinned():
                fenced += fences.fence(item.pinned_keys)
            self._quarantine.fence(fenced)
        else:
            for lease in leases:
                self._rollback_lease(lease)
        self._publish_manager_events()
        self.manager.reset_cache()
        if self._tiers is not None:
            self._tiers.on_reset()
        self._hub.publish(EventType.RESET, [])
