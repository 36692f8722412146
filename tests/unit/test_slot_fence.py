"""No slot changes owner while someone may still copy into it: resets and expired leases."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import anyio
import pytest

from kvcache_offload.aio import OffloadEngine
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import CapacityError, LeaseError
from tests.unit._api_app import BLOCK_BYTES, CAPACITY_BLOCKS, small_config, wait_for


def key(i: int) -> OffloadKey:
    return OffloadKey(i.to_bytes(8, "big") + b"\0\0\0\0")


def fill(byte: int) -> bytes:
    return bytes([byte]) * BLOCK_BYTES


class _GatedWrites:
    """Block memory writes of one byte value until released (a slow copy thread)."""

    def __init__(self, memory: Any, gated_byte: int) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self._write = memory.write
        self._gated = gated_byte

    def write(self, block_id: int, data: Any) -> None:
        if bytes(memoryview(data)[:1]) == bytes([self._gated]):
            self.entered.set()
            assert self.release.wait(10)
        self._write(block_id, data)


async def test_reset_waits_for_running_block_copies_so_no_other_key_gets_their_bytes() -> None:
    async with OffloadEngine(small_config()) as engine:
        memory = await engine._get_block_memory()
        gate = _GatedWrites(memory, ord("A"))
        memory.write = gate.write  # type: ignore[method-assign]
        a_keys = [key(100 + i) for i in range(CAPACITY_BLOCKS)]
        put_a = asyncio.create_task(engine.write_blocks(a_keys, [fill(ord("A"))] * len(a_keys)))
        await wait_for(gate.entered.is_set)
        reset = asyncio.create_task(engine.reset())

        async def put_k2_after_reset() -> None:
            await reset
            await engine.write_blocks([key(2)], [fill(ord("C"))])

        put_k2 = asyncio.create_task(put_k2_after_reset())
        with anyio.move_on_after(0.5):  # must not finish while A's copy still runs
            await asyncio.shield(put_k2)
        gate.release.set()
        stored = await put_a
        await put_k2
        assert await engine.read_block(key(2)) == fill(ord("C"))
        # The PUT of A finished before the reset: it was stored, then dropped by the reset.
        assert stored.keys_stored == a_keys
        assert (await engine.lookup(a_keys)).hits == 0


async def test_reset_waits_for_running_block_reads() -> None:
    async with OffloadEngine(small_config()) as engine:
        await engine.write_blocks([key(1)], [fill(ord("A"))])
        memory = await engine._get_block_memory()
        entered, release = threading.Event(), threading.Event()
        read = memory.read

        def slow_read(block_id: int) -> bytes:
            entered.set()
            assert release.wait(10)
            return read(block_id)

        memory.read = slow_read  # type: ignore[method-assign]
        reading = asyncio.create_task(engine.read_block(key(1)))
        await wait_for(entered.is_set)
        reset = asyncio.create_task(engine.reset())
        with anyio.move_on_after(0.3):
            await asyncio.shield(reset)
        assert not reset.done()
        release.set()
        assert await reading == fill(ord("A"))
        await reset


async def test_expired_store_lease_slots_are_not_reused_within_the_grace_period() -> None:
    config = small_config(cpu_bytes_to_use=2 * BLOCK_BYTES, lease_grace_s=60)
    async with OffloadEngine(config) as engine:
        await engine.write_blocks([key(1)], [fill(1)])
        late = await engine.prepare_store([key(2)], ttl_s=0.05)
        await wait_for(lambda: engine.stats().leases_expired["store"] == 1)
        assert engine.stats().blocks_fenced == 1
        assert (await engine.lookup([key(2)])).hits == 0
        # The only other slot holds key 1: storing evicts it rather than reusing the fenced one.
        stored = await engine.write_blocks([key(3)], [fill(3)])
        assert stored.evicted_keys == [key(1)]
        for i in range(4, 8):  # however many stores follow, none gets the fenced slot
            lease = await engine.prepare_store([key(i)])
            assert lease.block_ids != late.block_ids
            await engine.complete_store(lease.lease_id)
        # The late sidecar writer copies into its old slot: nobody else's block changes.
        memory = await engine._get_block_memory()
        memory.write(late.block_ids[0], fill(0xEE))
        assert await engine.read_block(key(7)) != fill(0xEE)
        with pytest.raises(LeaseError, match="expired"):
            await engine.complete_store(late.lease_id)


async def test_fenced_slots_are_free_again_after_the_grace_period() -> None:
    config = small_config(cpu_bytes_to_use=BLOCK_BYTES, lease_grace_s=0.05)
    async with OffloadEngine(config) as engine:
        await engine.prepare_store([key(2)], ttl_s=0.05)
        await wait_for(
            lambda: engine.stats().blocks_fenced == 0 and engine.stats().blocks_free == 1
        )
        assert (await engine.write_blocks([key(3)], [fill(3)])).keys_stored == [key(3)]


async def test_reset_fences_the_slots_of_open_sidecar_leases() -> None:
    config = small_config(cpu_bytes_to_use=2 * BLOCK_BYTES, lease_grace_s=60)
    async with OffloadEngine(config) as engine:
        writer = await engine.prepare_store([key(1)])
        await engine.reset()
        stats = engine.stats()
        assert (stats.blocks_fenced, stats.blocks_free) == (1, 1)
        stored = await engine.write_blocks([key(2)], [fill(2)])
        memory = await engine._get_block_memory()
        memory.write(writer.block_ids[0], fill(0xEE))  # the writer was still copying
        assert await engine.read_block(key(2)) == fill(2)
        assert stored.keys_stored == [key(2)]


async def test_expired_load_lease_keeps_its_block_pinned_for_the_grace_period() -> None:
    config = small_config(cpu_bytes_to_use=BLOCK_BYTES, lease_grace_s=60)
    async with OffloadEngine(config) as engine:
        await engine.write_blocks([key(1)], [fill(1)])
        await engine.prepare_load([key(1)], ttl_s=0.05)
        await wait_for(lambda: engine.stats().leases_expired["load"] == 1)
        # The late reader may still read slot 0: no store may evict key 1 meanwhile.
        with pytest.raises(CapacityError):
            await engine.write_blocks([key(2)], [fill(2)])
        assert await engine.read_block(key(1)) == fill(1)


async def test_block_memory_asked_for_twice_at_once_maps_the_shared_region_once() -> None:
    """The tier writer and the engine's start both ask for the block memory; a shared region
    must be mapped once (a second mapping in the same process is refused as another service)."""
    import asyncio

    from kvcache_offload.aio import OffloadEngine
    from tests._regions import region_name
    from tests.unit._api_app import small_config

    config = small_config(shared_region=True, region_name=region_name("twice"))
    engine = OffloadEngine(config)
    try:
        first, second = await asyncio.gather(engine._get_block_memory(), engine._get_block_memory())
        assert first is second
    finally:
        await engine.aclose()
