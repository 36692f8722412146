"""Optional capabilities of specs and managers are declared Protocols, and the engine's stats
fall back to zero for a spec or manager that lacks one (rather than failing or guessing)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvcache_offload.aio import OffloadEngine
from kvcache_offload.contracts.capabilities import CountsFencedSlots, SizesOffloadedBlocks
from kvcache_offload.contracts.handler import OffloadingHandler
from kvcache_offload.contracts.kv_caches import CanonicalKVCaches
from kvcache_offload.contracts.load_store_spec import LoadStoreSpec
from kvcache_offload.contracts.manager import OffloadingManager
from kvcache_offload.contracts.spec import OffloadingSpec
from kvcache_offload.control.manager import CPUOffloadingManager
from tests.unit._aio_fakes import BLOCK_BYTES, FakeSpec, small_config


class _SnapshotWithoutFences:
    num_blocks, policy, free, writing, idle, reading = 8, "lru", 8, 0, 0, 0


class _ManagerWithoutFences(CPUOffloadingManager):
    """A manager whose stats snapshot does not count fenced slots."""

    def stats(self) -> Any:
        return _SnapshotWithoutFences()


class _BareSpec(OffloadingSpec):
    """Only the required spec contract: it does not know its offloaded block's size."""

    def __init__(self) -> None:
        config = small_config(8)
        super().__init__(config, config.layout)
        self._manager = _ManagerWithoutFences(num_blocks=8)

    def get_manager(self) -> OffloadingManager:
        return self._manager

    def get_handlers(
        self, kv_caches: CanonicalKVCaches
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        return iter(())


def test_the_cpu_spec_and_manager_declare_block_bytes_and_fenced_slots() -> None:
    spec = FakeSpec(small_config(8))
    assert isinstance(spec, SizesOffloadedBlocks)
    assert isinstance(spec.get_manager().stats(), CountsFencedSlots)
    assert not isinstance(_BareSpec(), SizesOffloadedBlocks)
    assert not isinstance(_SnapshotWithoutFences(), CountsFencedSlots)


async def test_stats_of_the_cpu_spec_report_its_block_bytes_and_fenced_slots() -> None:
    async with OffloadEngine(spec=FakeSpec(small_config(8))) as engine:
        stats = engine.stats()
    assert stats.block_nbytes == BLOCK_BYTES
    assert stats.blocks_fenced == 0
    assert stats.capacity_blocks == 8


async def test_stats_without_those_capabilities_report_zero_instead_of_failing() -> None:
    async with OffloadEngine(spec=_BareSpec()) as engine:
        stats = engine.stats()
    assert stats.block_nbytes == 0
    assert stats.blocks_fenced == 0
    assert stats.capacity_blocks == 8
