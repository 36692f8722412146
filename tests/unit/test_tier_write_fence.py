"""A queued tier write never saves another key's bytes: slots that change owner are fenced.

The writer reads a key's bytes from its CPU slot when it reaches the key's job, which may be
long after the store completed. Whatever freed the slot meanwhile (discard, eviction, a failed
store, a reset) and whoever took it next, the tier must end up with the key's own bytes or
without the key.
"""

from __future__ import annotations

from pathlib import Path

from kvcache_offload import KVCacheLayout, OffloadConfig
from kvcache_offload.aio import OffloadEngine
from kvcache_offload.errors import BlockStateError
from tests.unit._aio_fakes import wait_for
from tests.unit._keys import key, keys
from tests.unit._slow_tier import SlowTier, unused_dir, use_tiers

BLOCK = 4096


def fill(byte: int) -> bytes:
    return bytes([byte]) * BLOCK


def config(tmp_path: Path, cpu_blocks: int = 4, **more: object) -> OffloadConfig:
    return OffloadConfig(
        cpu_bytes_to_use=cpu_blocks * BLOCK,
        layout=KVCacheLayout(bytes_per_block=BLOCK),
        backend="cpu",
        disk_path=unused_dir(tmp_path),
        **more,  # type: ignore[arg-type]
    )


async def read_or_miss(engine: OffloadEngine, k: object) -> bytes | None:
    try:
        return await engine.read_block(k)  # type: ignore[arg-type]
    except BlockStateError:
        return None


FILLERS = keys(100, 101, 102)


async def busy_writer_and_no_fresh_slot(engine: OffloadEngine, slow: SlowTier) -> None:
    """Hold the tier writer in a write of fillers that take all but one CPU slot (4 blocks),
    so the next store takes the last fresh slot and the one after a freed slot."""
    slow.gate.clear()
    await engine.write_blocks(FILLERS, [fill(0xF0)] * len(FILLERS))
    await wait_for(lambda: slow.puts_waiting == 1)


async def test_a_discarded_key_whose_slot_was_reused_is_not_written_with_the_new_bytes(
    tmp_path: Path,
) -> None:
    engine = OffloadEngine(config(tmp_path))
    slow = SlowTier()
    tier_set = use_tiers(engine, slow)
    async with engine:
        await busy_writer_and_no_fresh_slot(engine, slow)
        x, y = key(1), key(2)
        await engine.write_blocks([x], [fill(0xAA)])
        assert engine.discard_now([x]) == [x]
        await engine.write_blocks([y], [fill(0xBB)])  # takes X's freed slot
        slow.gate.set()
        assert await tier_set.drain(10)
        engine.discard_now([y, *FILLERS])
        assert await read_or_miss(engine, x) in (fill(0xAA), None)
        assert slow.blocks.get(x) in (fill(0xAA), None)
        assert await read_or_miss(engine, y) == fill(0xBB)


async def test_a_key_stored_again_in_its_old_slot_is_written_with_its_latest_bytes(
    tmp_path: Path,
) -> None:
    engine = OffloadEngine(config(tmp_path))
    slow = SlowTier()
    tier_set = use_tiers(engine, slow)
    async with engine:
        await busy_writer_and_no_fresh_slot(engine, slow)
        x = key(1)
        await engine.write_blocks([x], [fill(0xAA)])
        engine.discard_now([x])
        await engine.write_blocks([x], [fill(0xAB)])  # same key, same slot, new bytes
        slow.gate.set()
        assert await tier_set.drain(10)
        assert slow.blocks[x] == fill(0xAB)


async def test_every_queued_write_of_a_reset_or_evicted_tier_holds_its_own_bytes(
    tmp_path: Path,
) -> None:
    engine = OffloadEngine(config(tmp_path, cpu_blocks=4))
    slow = SlowTier()
    tier_set = use_tiers(engine, slow)
    async with engine:
        slow.gate.clear()
        await engine.write_blocks([key(100)], [fill(0xF0)])
        await wait_for(lambda: slow.puts_waiting == 1)
        for i in range(1, 9):  # twice the CPU tier: the first ones are evicted meanwhile
            await engine.write_blocks([key(i)], [fill(i)])
        await engine.reset()
        for i in range(11, 15):
            await engine.write_blocks([key(i)], [fill(i)])
        slow.gate.set()
        assert await tier_set.drain(10)
        for k, blob in slow.blocks.items():
            if k != key(100):
                assert blob == fill(int(k[:-4])), f"key {k[:-4]!r} holds another key's bytes"
        assert set(keys(11, 12, 13, 14)) <= set(slow.blocks)
