"""Random interleavings of every operation that frees or reuses a CPU slot never put a wrong
byte below the CPU tier, nor return one.

A hypothesis state machine drives a real engine (CPU backend, four CPU slots, so eviction is
constant) with a slow tier whose writes wait behind a gate the machine opens and closes:
stores (remote PUTs and sidecar leases), failed stores, reads (which promote keys held only
below), lookups, discards, releases and resets run while writes are queued. Each key's
content is a function of the key, as in a real KV cache, so a read answers that content or
misses, and the tier never holds anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvcache_offload import KVCacheLayout, OffloadConfig
from kvcache_offload.aio import OffloadEngine
from kvcache_offload.errors import BlockStateError, CapacityError
from tests.unit._keys import key
from tests.unit._slow_tier import SlowTier, use_tiers

BLOCK = 1024
CAPACITY = 4
KEYS = [key(i) for i in range(9)]

key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True)


def content(k: Any) -> bytes:
    seed = int(k[:-4])
    return bytes((seed * 37 + j) % 251 for j in range(BLOCK))


class TierWriteFence(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self._dir = tempfile.TemporaryDirectory()
        config = OffloadConfig(
            cpu_bytes_to_use=CAPACITY * BLOCK,
            layout=KVCacheLayout(bytes_per_block=BLOCK),
            backend="cpu",
            disk_path=self._dir.name,
            tier_queue_size=64,
        )
        self.loop = asyncio.new_event_loop()
        self.engine = OffloadEngine(config)
        self.slow = SlowTier()
        self.tier_set = use_tiers(self.engine, self.slow, queue_size=64)
        self.slow.gate.clear()  # writes start out held: the writer lags from the first store
        self.run(self.engine.start())
        self.memory = self.run(self.engine._get_block_memory())

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        try:
            self.slow.gate.set()
            assert self.run(self.tier_set.drain(10))
            self.check_tier_contents()
            self.run(self.engine.aclose())
        finally:
            self.loop.close()
            self._dir.cleanup()

    def settle(self, rounds: int) -> None:
        """Let background tasks (the tier writer, its copies) run a little."""

        async def spin() -> None:
            for _ in range(rounds):
                await asyncio.sleep(0)

        self.run(spin())

    # -- operations --------------------------------------------------------------------------

    @rule(ks=key_lists)
    def put(self, ks: list[Any]) -> None:
        with contextlib.suppress(CapacityError):
            self.run(self.engine.write_blocks(ks, [content(k) for k in ks]))

    @rule(ks=key_lists, success=st.booleans())
    def sidecar_store(self, ks: list[Any], success: bool) -> None:
        """A lease: the client writes the slots itself; a failed one leaves junk behind."""
        try:
            lease = self.run(self.engine.prepare_store(ks))
        except CapacityError:
            return
        for k, slot in zip(lease.keys_to_store, lease.block_ids, strict=True):
            self.memory.write(int(slot), content(k) if success else b"\xee" * BLOCK)
        self.run(self.engine.complete_store(lease.lease_id, success=success))

    @rule(k=st.sampled_from(KEYS))
    def get(self, k: Any) -> None:
        try:
            got = self.run(self.engine.read_block(k))
        except BlockStateError:
            return
        assert got == content(k), f"read of key {k[:-4]!r} returned another key's bytes"

    @rule(ks=key_lists)
    def put_and_get_together(self, ks: list[Any]) -> None:
        async def both() -> list[Any]:
            return await asyncio.gather(
                self.engine.write_blocks(ks, [content(k) for k in ks]),
                *(self.engine.read_block(k) for k in ks),
                return_exceptions=True,
            )

        _, *reads = self.run(both())
        for k, got in zip(ks, reads, strict=True):
            if isinstance(got, bytes):
                assert got == content(k), f"read of key {k[:-4]!r} returned wrong bytes"
            else:
                assert isinstance(got, (BlockStateError, CapacityError)), got

    @rule(ks=key_lists)
    def lookup(self, ks: list[Any]) -> None:
        self.run(self.engine.lookup(ks))

    @rule(ks=key_lists)
    def discard(self, ks: list[Any]) -> None:
        self.engine.discard_now(ks)

    @rule(gone=key_lists, ks=key_lists)
    def discard_then_put(self, gone: list[Any], ks: list[Any]) -> None:
        """A session ends and the next one stores at once: it takes the freed slots."""
        self.engine.discard_now(gone)
        self.put(ks)

    @rule(ks=key_lists)
    def release(self, ks: list[Any]) -> None:
        self.run(self.engine.release(ks))

    @rule()
    def reset(self) -> None:
        self.run(self.engine.reset())

    @rule()
    def hold_tier_writes(self) -> None:
        self.slow.gate.clear()

    @rule(rounds=st.integers(1, 20))
    def let_tier_writes_through(self, rounds: int) -> None:
        self.slow.gate.set()
        self.settle(rounds)

    # -- what must hold after every step -----------------------------------------------------

    @invariant()
    def check_tier_contents(self) -> None:
        for k, blob in self.slow.blocks.items():
            assert blob == content(k), f"the tier holds another key's bytes for {k[:-4]!r}"


TierWriteFence.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
test_tier_writes_hold_only_their_own_keys_bytes = TierWriteFence.TestCase
