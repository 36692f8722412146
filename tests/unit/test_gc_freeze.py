"""The engine keeps full garbage collections off the hot path by freezing the heap it finds."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from kvcache_offload import KVCacheLayout, OffloadConfig
from kvcache_offload.aio import OffloadEngine
from kvcache_offload.aio.gc_freeze import HeapFreeze


@pytest.fixture(autouse=True)
def nothing_frozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def _engine(**config: object) -> OffloadEngine:
    layout = KVCacheLayout(gpu_block_sizes=[16], bytes_per_block=64, num_gpu_blocks=8)
    return OffloadEngine(OffloadConfig(cpu_bytes_to_use=64 * 16, layout=layout, **config))


async def test_a_started_engine_freezes_the_heap_and_thaws_it_on_close() -> None:
    host_object: list[object] = [[]]  # a container the collector tracks
    async with _engine():
        assert gc.get_freeze_count() > 0
        assert not any(o is host_object for o in gc.get_objects())  # frozen: not walked
    assert gc.get_freeze_count() == 0
    assert any(o is host_object for o in gc.get_objects())


async def test_gc_freeze_false_leaves_the_collector_alone() -> None:
    async with _engine(transfer={"gc_freeze": False}):
        assert gc.get_freeze_count() == 0


async def test_a_heap_frozen_before_the_engine_stays_frozen() -> None:
    gc.freeze()  # a host (or a library at import time) froze its objects first
    host_object: list[object] = [[]]  # allocated since: the engine's freeze takes it too
    async with _engine() as engine:
        assert engine._heap_freeze.active
        assert not any(o is host_object for o in gc.get_objects())
    assert gc.get_freeze_count() > 0  # the engine did not thaw what it did not freeze alone
    assert not any(o is host_object for o in gc.get_objects())


def test_one_freeze_at_a_time_and_only_its_owner_thaws() -> None:
    first, second = HeapFreeze(), HeapFreeze()
    assert first.freeze() and first.active
    assert not second.freeze() and not second.active
    second.release()
    assert gc.get_freeze_count() > 0
    first.release()
    assert gc.get_freeze_count() == 0 and not first.active


def test_no_freeze_while_the_collector_is_off() -> None:
    gc.disable()
    try:
        assert not HeapFreeze().freeze()
        assert gc.get_freeze_count() == 0
    finally:
        gc.enable()
