"""``KVCacheOffloadSpec`` for vLLM 0.21: the spec API with ``get_handlers``.

vLLM builds the spec as ``spec_cls(vllm_config, kv_cache_config)``; its base class reads the
GPU block sizes and the offloaded block size from them. The scheduler side gets a vLLM
``OffloadingManager`` delegating to our manager; the worker side gets one vLLM
``OffloadingHandler`` per direction, each translating vLLM's job specs to ours.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    OffloadingSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.worker.worker import OffloadingHandler, TransferResult

from kvcache_offload import contracts as ours
from kvcache_offload.config import KVCacheLayout
from kvcache_offload.contracts.handler import OffloadingHandler as OurHandler
from kvcache_offload.integrations.vllm._backend import OffloadBackend
from kvcache_offload.integrations.vllm._manager_bridge import ManagerBridge
from kvcache_offload.integrations.vllm._observed_manager import LOAD_DIRECTION, STORE_DIRECTION
from kvcache_offload.integrations.vllm._settings import offload_config, side_port_settings
from kvcache_offload.integrations.vllm._translate import cpu_spec, gpu_spec

__all__ = ["KVCacheOffloadSpec"]


class KVCacheOffloadSpec(OffloadingSpec):  # type: ignore[misc]
    """kvcache-offload's manager, policies and handlers as a vLLM 0.21 offloading spec."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, kv_cache_config)
        events = vllm_config.kv_events_config
        vllm_events = bool(events is not None and events.enable_kv_cache_events)
        side_port = side_port_settings(self.extra_config)
        parallel = vllm_config.parallel_config
        engine_id = vllm_config.kv_transfer_config.engine_id
        config = offload_config(
            self.extra_config,
            layout=_layout(self.gpu_block_size, kv_cache_config, parallel.world_size),
            block_size=(
                self.gpu_block_size[0] * self.block_size_factor
                if self.block_size_factor > 1
                else None
            ),
            enable_events=vllm_events or side_port is not None,
            engine_id=engine_id,
        )
        self.backend = OffloadBackend(
            config, side_port=side_port, vllm_events=vllm_events, engine_id=engine_id
        )
        self.num_blocks = self.backend.num_blocks
        self._manager: _Manager | None = None
        self._handlers: tuple[_Handler, _Handler] | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = _Manager(self.backend.manager())
        return self._manager

    def get_handlers(
        self, kv_caches: Any
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        if self._handlers is None:
            # The world group exists in worker processes only, not in the scheduler's.
            world_size = self.vllm_config.parallel_config.world_size
            rank = _rank() if world_size > 1 else None
            store, load = self.backend.handlers(kv_caches, rank)
            self._handlers = (
                _Handler(store, self.backend, STORE_DIRECTION),
                _Handler(load, self.backend, LOAD_DIRECTION),
            )
        yield GPULoadStoreSpec, CPULoadStoreSpec, self._handlers[0]
        yield CPULoadStoreSpec, GPULoadStoreSpec, self._handlers[1]

    def shutdown(self) -> None:
        self.backend.shutdown()


def _layout(
    gpu_block_sizes: tuple[int, ...], kv_cache_config: Any, world_size: int
) -> KVCacheLayout:
    return KVCacheLayout(
        gpu_block_sizes=list(gpu_block_sizes),
        bytes_per_block=_bytes_per_block(kv_cache_config),
        num_gpu_blocks=kv_cache_config.num_blocks,
        world_size=world_size,
    )


def _bytes_per_block(kv_cache_config: Any) -> int:
    """One worker's KV bytes per GPU block: from the allocated tensors, else from the specs."""
    if kv_cache_config.num_blocks > 0 and kv_cache_config.kv_cache_tensors:
        total = sum(t.size for t in kv_cache_config.kv_cache_tensors)
        return int(total // kv_cache_config.num_blocks)
    return int(
        sum(
            group.kv_cache_spec.page_size_bytes * len(group.layer_names)
            for group in kv_cache_config.kv_cache_groups
        )
    )


def _rank() -> int:
    from vllm.distributed.parallel_state import get_world_group

    return int(get_world_group().rank_in_group)


class _Manager(ManagerBridge, OffloadingManager):  # type: ignore[misc]
    """vLLM's manager API over ours: same keys and semantics, vLLM's result classes."""

    def lookup(self, key: bytes, req_context: Any) -> bool | None:
        return self._manager.lookup(ours.OffloadKey(key), req_context)

    def take_events(self) -> Iterable[OffloadingEvent]:
        for event in self._manager.take_events():
            yield OffloadingEvent(keys=event.keys, medium=event.medium, removed=event.removed)


class _Handler(OffloadingHandler):  # type: ignore[misc]
    """One direction of our handlers, taking vLLM's (source, destination) job specs."""

    def __init__(self, handler: OurHandler, backend: OffloadBackend, direction: str) -> None:
        self._handler = handler
        self._backend = backend
        self._direction = direction

    def transfer_async(self, job_id: int, spec: tuple[Any, Any]) -> bool:
        src, dst = spec
        if getattr(src, "group_sizes", None) is not None:
            job: tuple[ours.LoadStoreSpec, ours.LoadStoreSpec] = (gpu_spec(src), cpu_spec(dst))
        else:
            job = (cpu_spec(src), gpu_spec(dst))
        return self._handler.transfer_async(job_id, job)

    def get_finished(self) -> list[TransferResult]:
        finished = self._handler.get_finished()
        self._backend.count_finished(self._direction, finished)
        return [
            TransferResult(
                job_id=r.job_id,
                success=r.success,
                transfer_size=r.transfer_size,
                transfer_time=r.transfer_time,
                transfer_type=r.transfer_type,
            )
            for r in finished
        ]

    def wait(self, job_ids: set[int]) -> None:
        self._handler.wait(job_ids)

    def shutdown(self) -> None:
        self._backend.shutdown()
