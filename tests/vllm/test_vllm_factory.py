"""vLLM's OffloadingSpecFactory builds our spec from kv_connector_extra_config alone."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import OffloadingSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvcache_offload.integrations.vllm import KVCacheOffloadSpec
from kvcache_offload.integrations.vllm._versions import api_generation
from tests.vllm._engine import SPEC, kv_cache_config, vllm_config

LAYERS = ["layer.0", "layer.1"]


def _create(extra: dict, *, kv_events: bool = False) -> KVCacheOffloadSpec:
    config = vllm_config({**SPEC, **extra}, kv_events=kv_events)
    kv_config = kv_cache_config(LAYERS, num_blocks=64)
    if api_generation() == "handlers":
        return OffloadingSpecFactory.create_spec(config, kv_config)
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )

    return OffloadingSpecFactory.create_spec(build_offloading_config(config, kv_config))


def test_the_factory_resolves_our_spec_by_name_and_module_path() -> None:
    spec = _create({"cpu_bytes_to_use": 1 << 20, "eviction_policy": "arc"})
    try:
        assert isinstance(spec, KVCacheOffloadSpec)
        assert isinstance(spec, OffloadingSpec)
        inner = spec.backend.config
        assert inner.eviction_policy == "arc"
        # 2 layers x K/V x 16 tokens x 2 heads x 8 dims x 2 bytes = 2 KiB per GPU block
        assert inner.layout.bytes_per_block == 2048
        assert spec.backend.num_blocks == (1 << 20) // 2048
        assert spec.get_manager()._manager.stats().policy == "arc"
    finally:
        spec.shutdown()


def test_the_offloaded_block_size_follows_vllms_block_size_key() -> None:
    spec = _create({"cpu_bytes_to_use": 1 << 20, "block_size": 64})
    try:
        assert spec.backend.spec.block_size_factor == 4
        assert spec.backend.num_blocks == (1 << 20) // (4 * 2048)
    finally:
        spec.shutdown()


def test_foreign_keys_are_logged_not_rejected(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvcache_offload"):
        spec = _create({"cpu_bytes_to_use": 1 << 20, "lmcache.chunk_size": 256})
    spec.shutdown()
    assert "lmcache.chunk_size" in caplog.text


@pytest.mark.parametrize("kv_events", [False, True])
def test_events_follow_vllms_kv_events_setting(kv_events: bool) -> None:
    spec = _create({"cpu_bytes_to_use": 1 << 20, "enable_events": True}, kv_events=kv_events)
    try:
        assert spec.backend.config.enable_events is kv_events
        manager = spec.get_manager()
        output = manager.prepare_store([b"block-hash\x00\x00\x00\x00"], _context())
        assert output is not None
        manager.complete_store(output.keys_to_store, _context())
        events = list(manager.take_events())
        assert [(e.keys, e.removed) for e in events] == (
            [([b"block-hash\x00\x00\x00\x00"], False)] if kv_events else []
        )
    finally:
        spec.shutdown()


def _context():
    from vllm.v1.kv_offload.base import ReqContext

    return ReqContext(**({"req_id": "r"} if "req_id" in ReqContext.__dataclass_fields__ else {}))
