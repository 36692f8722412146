"""The engine's lifecycle: start, reset and close.

One background runner task (``EngineCore._ensure_started``) owns an anyio task group with the
transfer poller, the lease reaper, the KV-event publisher and the tier writer; it starts on
``async with`` (or on the first operation that needs it) and ends in :meth:`Lifecycle.aclose`,
which also finishes or fails in-flight jobs, rolls open leases back and releases every resource
the engine holds.
"""

from __future__ import annotations

import logging

import anyio

from kvcache_offload.aio.engine_block_bytes import BlockBytes
from kvcache_offload.aio.engine_core import EngineCore, EnginePart
from kvcache_offload.aio.types import EventType
from kvcache_offload.contracts.capabilities import ShutsDown
from kvcache_offload.errors import TransferError

__all__ = ["Lifecycle"]

logger = logging.getLogger("kvcache_offload.aio.engine")


class Lifecycle(EnginePart):
    """``start``, ``aclose`` and ``reset`` (the engine's ``async with`` calls the first two)."""

    def __init__(self, core: EngineCore, blocks: BlockBytes) -> None:
        super().__init__(core)
        self._blocks = blocks

    async def start(self) -> None:
        """Start the background tasks and, for a shared region, set the region up off-loop."""
        c = self._core
        c._check_open()
        c._ensure_started()
        if c.config.shared_region and c._block_memory is None:
            await self._blocks.get_block_memory()
        if c._tiers is not None:
            await c._tiers.open()
        if c.config.transfer.gc_freeze:
            c._heap_freeze.freeze()

    async def aclose(self) -> None:
        """Finish or fail in-flight jobs, roll back leases, stop tasks, release everything.

        Idempotent and shielded from cancellation, so it also cleans up after errors.
        """
        c = self._core
        if c._closed:
            return
        c._closed = True
        with anyio.CancelScope(shield=True):
            poller = c._poller
            if poller is not None and poller.in_flight:
                drained = False
                if c._runner is not None and not c._runner.done():
                    drained = await poller.drain(c.close_timeout_s)
                if not drained:
                    n = poller.fail_all("the engine closed before the transfer finished")
                    logger.warning("closed with %d transfers still in flight", n)
            for lease in c._leases.take_all():
                c._rollback_lease(lease)
            if c._tiers is not None:  # queued tier writes finish while the writer runs
                await c._tiers.aclose(c.close_timeout_s if c._runner else 0.0)
            if c._runner is not None and c._stop is not None:
                c._stop.set()
                try:
                    await c._runner
                except BaseException:
                    logger.debug("background task ended with an error", exc_info=True)
            c._hub.close()
            if c._kv_events is not None:
                try:
                    await c._kv_events.aclose()
                except Exception:
                    logger.exception("closing the KV-event publisher failed")
            if c._worker is not None:
                try:
                    await anyio.to_thread.run_sync(c._worker.shutdown)
                except Exception:
                    logger.exception("shutting the worker down failed")
            if c._block_memory is not None:
                c._guard(c._block_memory.close, "closing block memory")
            c._guard(c.manager.shutdown, "shutting the manager down")
            if isinstance(c.spec, ShutsDown):  # handlers, memory, region (file work)
                try:
                    await anyio.to_thread.run_sync(c.spec.shutdown)
                except Exception:
                    logger.exception("shutting the spec down failed")
            c._heap_freeze.release()

    async def reset(self) -> None:
        """Drop every offloaded block once in-flight jobs and block copies finished.

        Open leases roll back; their slots (which sidecar clients may still be copying) stay
        fenced for the grace period, so a late copy never lands in a block of another key.
        """
        c = self._core
        c._check_open()
        poller = c._poller
        copies = c._copies
        while (poller is not None and poller.in_flight) or copies.running:
            if poller is not None and poller.in_flight:
                c._ensure_started()
                if not await poller.drain(c.close_timeout_s):
                    raise TransferError("reset gave up waiting for in-flight transfers")
            if not await copies.wait_idle(c.close_timeout_s):
                raise TransferError("reset gave up waiting for in-flight block copies")
        # From here on everything is synchronous: no job, copy or lease can sneak in.
        fences = c._fences
        leases = c._leases.take_all()
        if fences is not None and c._quarantine.grace_s > 0:
            fenced: list[int] = []
            for lease in leases:
                fenced += fences.fence(lease.keys)
                if lease.kind == "store":
                    c._totals.store_blocks_failed += len(lease.keys)
            for item in c._quarantine.take_pinned():
                fenced += fences.fence(item.pinned_keys)
            c._quarantine.fence(fenced)
        else:
            for lease in leases:
                c._rollback_lease(lease)
        c._publish_manager_events()
        c.manager.reset_cache()
        if c._tiers is not None:
            c._tiers.on_reset()
        c._hub.publish(EventType.RESET, [])
