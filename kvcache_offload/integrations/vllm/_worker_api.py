"""``KVCacheOffloadSpec`` for vLLM 0.33: the spec API with ``get_worker``.

vLLM builds the spec as ``spec_cls(offloading_config)``, a normalized ``OffloadingConfig`` that
already holds the per-group block sizes, the KV bytes per block, the chunk size and the
KV-events setting. The scheduler side gets a vLLM ``OffloadingManager`` (``lookup`` answers a
``LookupResult``); the worker side gets one vLLM ``OffloadingWorker`` whose ``submit_store`` /
``submit_load`` translate vLLM's job specs to ours and feed our two handlers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo, CPUOffloadingMetrics
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvcache_offload import contracts as ours
from kvcache_offload.config import KVCacheLayout
from kvcache_offload.contracts.capabilities import ReportsStats, SkipsStores
from kvcache_offload.contracts.handler import OffloadingHandler
from kvcache_offload.contracts.handler import TransferResult as OurResult
from kvcache_offload.errors import ConfigError
from kvcache_offload.integrations.vllm import _request_keys as request_keys
from kvcache_offload.integrations.vllm._backend import OffloadBackend
from kvcache_offload.integrations.vllm._manager_bridge import ManagerBridge
from kvcache_offload.integrations.vllm._observed_manager import LOAD_DIRECTION, STORE_DIRECTION
from kvcache_offload.integrations.vllm._settings import offload_config, side_port_settings
from kvcache_offload.integrations.vllm._translate import cpu_spec, gpu_spec

__all__ = ["KVCacheOffloadSpec"]

_LOOKUP = {True: LookupResult.HIT, False: LookupResult.MISS, None: LookupResult.HIT_PENDING}


class KVCacheOffloadSpec(OffloadingSpec):  # type: ignore[misc]
    """kvcache-offload's manager, policies and handlers as a vLLM 0.33 offloading spec."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """vLLM's own CPU tier metrics (``vllm:kv_offload_cpu_cache_usage_perc``, ...), with
        vLLM's names and help texts: a dashboard built on them keeps working after the
        switch. The manager reports them (:meth:`_Manager.get_stats`)."""
        return dict(CPUOffloadingSpec.build_metric_definitions(extra_config))

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """The labels of ``vllm:kv_offload_config_info``: vLLM's CPU tier facts."""
        return tuple(CPUOffloadingSpec.config_info_keys(extra_config))

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        if config.canonical_layout:
            raise ConfigError(
                "vLLM's canonical host layout (canonical_layout) is not supported by "
                "kvcache-offload; leave it off in kv_connector_extra_config"
            )
        if config.worker_kv_bytes_per_block <= 0:
            raise ConfigError(
                f"vLLM reported {config.worker_kv_bytes_per_block} KV bytes per block; "
                "kvcache-offload needs the KV-cache size to size its CPU tier"
            )
        parallel = config.parallel
        layout = KVCacheLayout(
            gpu_block_sizes=list(self.tokens_per_block),
            bytes_per_block=config.worker_kv_bytes_per_block,
            world_size=parallel.world_size,
        )
        side_port = side_port_settings(self.extra_config)
        vllm_events = bool(config.enable_kv_cache_events)
        ours_config = offload_config(
            self.extra_config,
            layout=layout,
            block_size=(
                self.tokens_per_block[0] * self.blocks_per_chunk
                if self.blocks_per_chunk > 1
                else None
            ),
            enable_events=vllm_events or side_port is not None,
            engine_id=config.engine_id,
        )
        self.backend = OffloadBackend(
            ours_config, side_port=side_port, vllm_events=vllm_events, engine_id=config.engine_id
        )
        self.num_chunks = self.backend.num_blocks
        bytes_per_chunk = int(getattr(self.backend.spec, "kv_bytes_per_offloaded_block", 0) or 0)
        # vLLM's own facts about a CPU tier (slots, bytes, tokens at max_model_len), computed
        # by vLLM from our sizes for its info metric.
        self.cpu_info = CPUOffloadingInfo.from_config(config, self.num_chunks, bytes_per_chunk)
        self._manager: _Manager | None = None
        self._worker: _Worker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = _Manager(self.backend.manager(), self.cpu_info.as_config_info())
        return self._manager

    def get_worker(self, kv_caches: Any) -> OffloadingWorker:
        if self._worker is None:
            parallel = self.config.parallel
            rank = parallel.rank if parallel.world_size > 1 else None
            self._worker = _Worker(*self.backend.handlers(kv_caches, rank), self.backend)
        return self._worker

    def shutdown(self) -> None:
        self.backend.shutdown()


class _Manager(ManagerBridge, OffloadingManager):  # type: ignore[misc]
    """vLLM's manager API over ours: same keys and semantics, vLLM's result classes."""

    def __init__(self, manager: ours.OffloadingManager, info: Any = None) -> None:
        super().__init__(manager)
        self._info = dict(info) if info else {}
        self._allocations: list[int] = []
        """Blocks each successful ``prepare_store`` allocated since the last ``get_stats``."""
        self._skipped_reported = 0

    def lookup(self, key: bytes, req_context: Any) -> Any:
        return _LOOKUP[self._manager.lookup(ours.OffloadKey(key), req_context)]

    def on_new_request(self, req_context: Any) -> Any:
        return RequestOffloadingContext()

    # This generation's scheduler never calls ``touch``: the bridge replays 0.21's touches
    # from the keys each request loads or offers to store (see ``_request_keys``).

    def prepare_load(self, keys: Any, req_context: Any) -> Any:
        keys = list(keys)
        spec = super().prepare_load(keys, req_context)
        request_keys.loaded(req_context, keys)
        return spec

    def prepare_store(self, keys: Any, req_context: Any) -> Any:
        keys = list(keys)
        prepare = super().prepare_store
        output = request_keys.storing(
            req_context, keys, self.touch, lambda: prepare(keys, req_context)
        )
        if output is not None and output.keys_to_store:
            self._allocations.append(len(output.keys_to_store))
        return output

    def on_request_finished(self, req_context: Any) -> None:
        request_keys.finished(req_context, self.touch)

    def config_info(self) -> list[Any]:
        return [self._info]

    def get_load_source(self, key: Any, req_context: Any) -> Any:
        return CacheHitSource.HOST  # the tier is host memory, as vLLM's own CPU tier

    def get_stats(self) -> Any:
        """vLLM's CPU tier metrics from our manager: the shares of the tier pinned by stores
        and loads in flight, the blocks each successful store allocated since the last call,
        and the stores the reuse filter skipped (with ``store_threshold`` 2 or more)."""
        stats = OffloadingConnectorStats()
        manager = self._manager
        snap = manager.stats() if isinstance(manager, ReportsStats) else None
        if snap is not None and snap.num_blocks > 0:
            writing, reading = snap.writing / snap.num_blocks, snap.reading / snap.num_blocks
            stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, writing + reading)
            stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, writing)
            stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, reading)
        for size in self._allocations:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
        self._allocations.clear()
        if isinstance(manager, SkipsStores):
            skipped = int(manager.stores_skipped)
            stats.increase_counter(
                CPUOffloadingMetrics.STORES_SKIPPED, skipped - self._skipped_reported
            )
            self._skipped_reported = skipped
        return stats

    def take_events(self) -> Iterable[OffloadingEvent]:
        for event in self._manager.take_events():
            yield OffloadingEvent(
                keys=event.keys, medium=Medium(event.medium), removed=event.removed
            )


class _Worker(OffloadingWorker):  # type: ignore[misc]
    """Our store and load handlers behind vLLM's one-worker API."""

    def __init__(
        self, store: OffloadingHandler, load: OffloadingHandler, backend: OffloadBackend
    ) -> None:
        self._store = store
        self._load = load
        self._backend = backend

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: Any) -> bool:
        return self._store.transfer_async(job_id, (gpu_spec(src_spec), cpu_spec(dst_spec)))

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        return self._load.transfer_async(job_id, (cpu_spec(src_spec), gpu_spec(dst_spec)))

    def get_finished(self) -> list[TransferResult]:
        stored, loaded = self._store.get_finished(), self._load.get_finished()
        self._backend.count_finished(STORE_DIRECTION, stored)
        self._backend.count_finished(LOAD_DIRECTION, loaded)
        return [_result(r) for r in (*stored, *loaded)]

    def wait(self, job_ids: set[int]) -> None:
        self._store.wait(job_ids)
        self._load.wait(job_ids)

    def shutdown(self) -> None:
        self._backend.shutdown()


def _result(result: OurResult) -> Any:
    return TransferResult(
        job_id=result.job_id,
        success=result.success,
        transfer_size=result.transfer_size,
        transfer_time=result.transfer_time,
    )
