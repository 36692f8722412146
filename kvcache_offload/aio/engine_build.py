"""Building the engine's pieces from its spec and config: the worker, the KV-event publisher
and the secondary tiers. A piece that fails to build shuts the spec down first."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcache_offload.aio.tiering import EngineTiers
from kvcache_offload.aio.types import EventType
from kvcache_offload.config import OffloadConfig
from kvcache_offload.contracts.kv_caches import CanonicalKVCaches
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.dataplane.handlers.router import OffloadingWorker

if TYPE_CHECKING:
    from kvcache_offload.aio.engine_block_bytes import BlockBytes
    from kvcache_offload.aio.engine_core import EngineCore
    from kvcache_offload.kv_events.publisher import KVEventPublisher

__all__ = ["build_tiers", "build_worker", "open_kv_events"]


def build_worker(core: EngineCore, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
    """The worker with the spec's handlers registered (the spec shut down if that fails)."""
    worker = OffloadingWorker()
    try:
        for src_cls, dst_cls, handler in core.spec.get_handlers(kv_caches):
            worker.register_handler(src_cls, dst_cls, handler)
    except BaseException:
        worker.shutdown()
        core._shutdown_spec("shutting the spec down after a failed start")
        raise
    return worker


def open_kv_events(core: EngineCore, config: OffloadConfig) -> KVEventPublisher:
    """The ZMQ publisher of block events for routers (docs/kv-events.md)."""
    from kvcache_offload.kv_events.publisher import KVEventPublisher

    factor = core.spec.block_size_factor
    try:
        return KVEventPublisher(
            core._hub,
            str(config.kv_events_endpoint),
            replay_endpoint=config.kv_events_replay_endpoint,
            topic=config.kv_events_topic,
            encoding=config.kv_events_encoding,
            hash_format=config.kv_events_hash_format,
            block_sizes=[size * factor for size in core.spec.gpu_block_size],
            media=config.kv_events_media,
            replay_batches=max(config.kv_events_replay_batches or 0, config.event_buffer_size),
            hwm=config.kv_events_hwm,
            data_parallel_rank=config.kv_events_data_parallel_rank,
        )
    except BaseException:
        core._shutdown_spec("shutting the spec down after a failed start")
        raise


def build_tiers(core: EngineCore, blocks: BlockBytes) -> EngineTiers | None:
    """Secondary tiers from the config (disk, Redis, object store), or None: then no hook costs
    anything."""
    cfg = core.config
    if cfg.disk_path is None and not cfg.remote_url and not cfg.object_url:
        return None
    from kvcache_offload.tiers import TierSet, layout_fingerprint, tiers_from_config

    fingerprint = layout_fingerprint(
        model_id=cfg.model_id,
        kv_dtype=cfg.kv_dtype,
        block_nbytes=cfg.layout.bytes_per_block * core._factor,
        block_tokens=core.spec.gpu_block_size[0] * core._factor,
        gpu_block_sizes=cfg.layout.gpu_block_sizes,
        world_size=cfg.layout.world_size,
    )
    tiers = tiers_from_config(cfg, fingerprint)
    if not tiers:
        return None

    def publish(kind: str, keys: list[OffloadKey], medium: str) -> None:
        core._hub.publish(EventType(kind), keys, medium=medium)

    tier_set = TierSet(
        tiers,
        queue_size=cfg.tier_queue_size,
        read_timeout_s=cfg.tier_read_timeout_s,
        on_event=publish,
        block_nbytes=cfg.layout.bytes_per_block * core._factor,
    )
    engine_tiers = EngineTiers(
        tier_set, core.manager, blocks.get_block_memory, blocks.write_blocks, cfg.tier_write
    )
    if cfg.tier_write_backpressure:
        engine_tiers.backpressure_s = cfg.tier_write_backpressure_timeout_s
    return engine_tiers
