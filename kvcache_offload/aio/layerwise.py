"""Layer-wise loads: ``load``'s keys, pins and events, with a copy that completes per layer.

``await engine.load_layerwise(keys, gpu_blocks)`` decides exactly what ``load`` decides
(promotion from lower tiers, the manager's ``prepare_load`` pins, the same load events), but
returns as soon as the copy is issued, with a :class:`LayerwiseLoad` handle:
``handle.wait_layer(i, stream)`` makes the model's stream wait on layer i's copy (CUDA; a
host wait on the CPU backend), so the model computes layer i while later layers still copy;
``await handle.done()`` gives the :class:`LoadResult`.

Pins never outlive the job: a watcher task owned by :class:`LayerwiseLoads` completes the
load with the manager once the last layer's copy ended (or failed, or was cancelled), whether
or not anybody awaits ``done()``. ``handle.cancel()`` copies no further layer where that is
still possible; the load then finishes as failed. The engine's ``aclose`` waits for these
watchers before it shuts the handlers down.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvcache_offload.aio.engine_core import LOAD_DIRECTION
from kvcache_offload.aio.gpu_specs import gpu_spec_for_keys
from kvcache_offload.aio.types import LoadResult, job_load_result
from kvcache_offload.contracts.manager import ReqContext
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import ConfigError, TransferError

if TYPE_CHECKING:
    from kvcache_offload.aio.engine_core import EngineCore
    from kvcache_offload.aio.engine_jobs import GpuBlocks
    from kvcache_offload.dataplane.layer_copies import LayerCopier, LayerCopies

__all__ = ["LayerwiseLoad", "LayerwiseLoads"]

_POLL_START_S = 50e-6
_POLL_MAX_S = 2e-3


class LayerwiseLoad:
    """The handle of one layer-wise load (see the module docstring)."""

    def __init__(
        self, keys: list[OffloadKey], copies: LayerCopies, finished: asyncio.Future[LoadResult]
    ) -> None:
        self.keys = keys
        self._copies = copies
        self._finished = finished

    @property
    def num_layers(self) -> int:
        return self._copies.num_layers

    @property
    def num_bytes(self) -> int:
        return self._copies.num_bytes

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        """Make ``stream`` (default: the current CUDA stream) wait on layer ``layer``'s copy
        without a host synchronisation; on the CPU backend, return once it is copied.
        Raises :class:`TransferError` for a layer that was not copied."""
        self._copies.wait_layer(layer, stream)

    def layer_done(self, layer: int) -> bool:
        """Whether layer ``layer`` is in place now (never blocks)."""
        return self._copies.layer_done(layer)

    def cancel(self) -> None:
        """Copy no further layer where that is still possible; the load finishes failed."""
        self._copies.cancel()

    async def done(self) -> LoadResult:
        """The load's result once every layer is copied and the pins are released; raises
        :class:`TransferError` when the copy failed or was cancelled. Cancelling this await
        leaves the job to finish on its own (its pins are released all the same)."""
        return await asyncio.shield(self._finished)


class LayerwiseLoads:
    """An engine's layer-wise loads: their copier and the watchers that finish them."""

    def __init__(self, engine: EngineCore) -> None:
        self._engine = engine
        self._copier: LayerCopier | None = None
        self._watchers: set[asyncio.Task[None]] = set()

    def _get_copier(self) -> LayerCopier:
        if self._copier is None:
            worker = self._engine._worker
            handler = worker.transfer_type_to_handler.get(("CPU", "GPU")) if worker else None
            if handler is None:
                raise ConfigError(
                    "no KV caches registered: pass kv_caches= to OffloadEngine to load "
                    "GPU blocks layer by layer"
                )
            from kvcache_offload.dataplane.layer_copies import LayerCopier

            self._copier = LayerCopier(handler)
        return self._copier

    async def load(
        self,
        keys: Sequence[OffloadKey],
        gpu_blocks: GpuBlocks,
        req_context: ReqContext | None,
        refs_per_layer: int,
    ) -> LayerwiseLoad:
        engine = self._engine
        copier = self._get_copier()
        ctx = req_context if req_context is not None else ReqContext()
        keys = list(keys)
        if not keys:
            raise ConfigError("a layer-wise load needs at least one key")
        tiers = engine._tiers
        if tiers is not None and not tiers.holds_all(keys):
            await tiers.promote(keys)
        gpu_spec = gpu_spec_for_keys(
            keys, gpu_blocks, factor=engine._factor, num_groups=engine._num_groups
        )
        if engine._closed:
            engine._check_open()
        cpu_spec = engine.manager.prepare_load(keys, ctx)
        try:
            copies = copier.start((cpu_spec, gpu_spec), refs_per_layer)
        except BaseException:
            engine._finish_load(keys, ctx, False, {"reason": "transfer refused"})
            raise
        finished: asyncio.Future[LoadResult] = asyncio.get_running_loop().create_future()
        task = asyncio.get_running_loop().create_task(
            self._watch(keys, ctx, copies, finished), name="kvcache-offload-layerwise"
        )
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)
        return LayerwiseLoad(keys, copies, finished)

    async def _watch(
        self,
        keys: list[OffloadKey],
        ctx: ReqContext,
        copies: LayerCopies,
        finished: asyncio.Future[LoadResult],
    ) -> None:
        """Finish the load with the manager once the copy ended; the clean-up runs in
        ``finally``, so the pins are released whatever happens to this task."""
        engine = self._engine
        outcome: bool | None = None
        pause = _POLL_START_S
        try:
            while (outcome := copies.finished()) is None:
                await asyncio.sleep(pause)
                pause = min(2 * pause, _POLL_MAX_S)
        finally:
            # Cancelled while copies were in flight (only at shutdown, after drain's timeout):
            # the bytes may still land, so the load reports failure.
            success = bool(outcome)
            try:
                if success:
                    engine._record_copy(LOAD_DIRECTION, copies.num_bytes, copies.seconds)
                engine._finish_load(keys, ctx, success, {"layerwise": True})
            finally:
                self._settle(finished, keys, copies, success)

    @staticmethod
    def _settle(
        finished: asyncio.Future[LoadResult],
        keys: list[OffloadKey],
        copies: LayerCopies,
        success: bool,
    ) -> None:
        if not finished.done():
            if success:
                finished.set_result(job_load_result(keys, copies.num_bytes, copies.seconds))
            else:
                finished.set_exception(
                    TransferError(f"layer-wise load of {len(keys)} blocks did not complete")
                )
                finished.exception()  # retrieved: nobody need await done()

    async def drain(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) for every watcher, then stop the copier's thread."""
        if self._watchers:
            _, pending = await asyncio.wait(set(self._watchers), timeout=timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        if self._copier is not None:
            self._copier.close()
