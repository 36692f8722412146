"""One-shot transfer jobs: ``store`` and ``load`` between registered GPU blocks and the CPU tier.

Pins never outlive an operation: a transfer's completion callback (run by the poller, not by
the awaiting coroutine) completes the store or load even if the caller was cancelled; a
refused or failed transfer completes the store with ``success=False``. (A lone job's caller
may look for the end itself, through the poller; a cancelled one hands it back.)
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Generator, Sequence

import numpy as np

from kvcache_offload.aio.engine_core import LOAD_DIRECTION, STORE_DIRECTION, EnginePart
from kvcache_offload.aio.gpu_specs import gpu_spec_for_keys
from kvcache_offload.aio.poller import COLLECT, LOOK, TransferPoller
from kvcache_offload.aio.types import LoadResult, StoreResult, job_load_result, job_store_result
from kvcache_offload.contracts.handler import TransferResult
from kvcache_offload.contracts.load_store_spec import GPULoadStoreSpec
from kvcache_offload.contracts.manager import ReqContext
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import ConfigError, TransferError

__all__ = ["GpuBlocks", "TransferJobs"]

_NO_CONTEXT = ReqContext()
"""The context of a job whose caller passed none (as for lookups): nothing here or in the
manager writes to it, so one serves every such job."""


@types.coroutine
def one_loop_turn() -> Generator[None, None, None]:
    """Give the event loop one turn (what ``asyncio.sleep(0)`` does, one call less).

    A job whose copy finished while it was submitted is collected by its caller after this
    turn rather than by the poller task: the caller still yields once, as before (the
    poller's turn came after it in the same loop iteration), and the task is not woken."""
    yield


async def _settle(
    poller: TransferPoller, future: asyncio.Future[TransferResult], mode: int
) -> None:
    """What :meth:`TransferPoller.submit_job` asked the caller to do before it awaits its
    job's future."""
    if mode == COLLECT:  # the copy finished during submission (a small one, done inline)
        try:
            await one_loop_turn()
        finally:  # cancelled or not: the job completes now, on this turn
            poller.collect_now()
    elif mode == LOOK:  # a lone job: look for its end on this task's turns
        try:
            # Yield first, as every job's await did: a small copy is often done by the
            # first look, and a caller that never yields starves every other coroutine (an
            # H200 stress run: 16 tasks, one ran jobs back to back while another's keys
            # aged out of the tier before its next step).
            await one_loop_turn()
            while not future.done() and poller.caller_look():
                await one_loop_turn()
        finally:  # done, given up or cancelled: a job still in flight goes to the poller
            poller.caller_stop(future)


GpuBlocks = Sequence[int] | np.ndarray | GPULoadStoreSpec


class TransferJobs(EnginePart):
    """``store`` and ``load``: submit one job to the poller and await its result."""

    def _begin(self, req_context: ReqContext | None) -> tuple[TransferPoller, ReqContext]:
        """A job's poller (a typed error without KV caches) and request context."""
        poller = self._core._poller
        if poller is None:
            raise ConfigError(
                "no KV caches registered: pass kv_caches= to OffloadEngine to store or load "
                "GPU blocks (sidecar clients use prepare_store/prepare_load instead)"
            )
        return poller, req_context if req_context is not None else _NO_CONTEXT

    async def store(
        self,
        keys: Sequence[OffloadKey],
        gpu_blocks: GpuBlocks,
        req_context: ReqContext | None = None,
    ) -> StoreResult:
        """Offload ``keys`` from ``gpu_blocks`` (``block_size_factor`` ids per key).

        Keys already offloaded are skipped. Raises :class:`CapacityError` when there is no
        room and :class:`TransferError` when the copy failed (the store is then rolled back).
        """
        c = self._core
        poller, ctx = self._begin(req_context)
        keys = list(keys)
        # The manager's events (its evictions) are published once the copy is on its way:
        # a lone store's copy starts that much sooner, and nothing else runs on the loop in
        # between, so subscribers see the same events in the same order.
        if c._tiers is not None:
            await c._tier_room(keys)
        out = c._prepare_store(keys, ctx, publish=False)
        stored = out.keys_to_store
        try:
            if not stored:
                return StoreResult([], out.evicted_keys)
            try:
                gpu_spec = gpu_spec_for_keys(
                    keys,
                    gpu_blocks,
                    factor=c._factor,
                    num_groups=c._num_groups,
                    # Every key stored (the common case): no selection to apply.
                    selected=None if stored == keys else self._positions(keys, stored),
                )
            except BaseException:
                c._publish_manager_events()
                c._finish_store(stored, ctx, False, "invalid GPU block ids")
                raise

            def on_done(result: TransferResult) -> None:
                success = result.success
                if success:
                    c._record_copy(STORE_DIRECTION, result.transfer_size, result.transfer_time)
                c._finish_store(stored, ctx, success, "transfer failed")

            if c._runner is None:
                c._ensure_started()
            try:
                future, mode = poller.submit_job((gpu_spec, out.store_spec), on_done, True)
            except BaseException:
                c._publish_manager_events()
                c._finish_store(stored, ctx, False, "transfer refused")
                raise
            # A lone store's copy is on its way (not done during the submission, nothing
            # else in flight): choose the next store's victims in its shadow. Behind other
            # jobs, or after an inline copy, there is no shadow: stores choose at need.
            if c._evict_ahead_max and mode != COLLECT and poller.lone_in_flight():
                c._evict_ahead(len(stored))
        finally:
            c._publish_manager_events()  # a no-op when published above
        if mode:
            await _settle(poller, future, mode)
        result = await future
        if not result.success:
            raise TransferError(f"storing {len(stored)} blocks failed (job {result.job_id})")
        return job_store_result(
            stored, out.evicted_keys, result.transfer_size or 0, result.transfer_time or 0.0
        )

    @staticmethod
    def _positions(keys: list[OffloadKey], subset: list[OffloadKey]) -> list[int]:
        """Index in ``keys`` of each key of ``subset`` (first occurrence)."""
        if len(subset) == len(keys) and subset == keys:
            return list(range(len(keys)))
        first: dict[OffloadKey, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        return [first[k] for k in subset]

    async def load(
        self,
        keys: Sequence[OffloadKey],
        gpu_blocks: GpuBlocks,
        req_context: ReqContext | None = None,
    ) -> LoadResult:
        """Copy ready ``keys`` back into ``gpu_blocks``.

        Raises :class:`BlockStateError` if a key is not ready (nothing is pinned then) and
        :class:`TransferError` if the copy failed (the blocks are unpinned).
        """
        c = self._core
        poller, ctx = self._begin(req_context)
        keys = list(keys)
        if not keys:
            return LoadResult([])
        if c._tiers is not None and not c._tiers.holds_all(keys):
            await c._tiers.promote(keys)
        gpu_spec = gpu_spec_for_keys(keys, gpu_blocks, factor=c._factor, num_groups=c._num_groups)
        if c._closed:
            c._check_open()
        cpu_spec = c.manager.prepare_load(keys, ctx)

        def on_done(result: TransferResult) -> None:
            success = result.success
            if success:
                c._record_copy(LOAD_DIRECTION, result.transfer_size, result.transfer_time)
            c._finish_load_job(keys, ctx, success, result.job_id)

        if c._runner is None:
            c._ensure_started()
        try:
            future, mode = poller.submit_job((cpu_spec, gpu_spec), on_done, True)
        except BaseException:
            c._finish_load(keys, ctx, False, {"reason": "transfer refused"})
            raise
        if mode:
            await _settle(poller, future, mode)
        result = await future
        if not result.success:
            raise TransferError(f"loading {len(keys)} blocks failed (job {result.job_id})")
        return job_load_result(keys, result.transfer_size or 0, result.transfer_time or 0.0)
