"""Random interleavings of engine operations never leave a block pinned once all settle."""

from __future__ import annotations

import asyncio
import contextlib

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache_offload.errors import OffloadError
from tests.unit._aio_fakes import FakeHandler, wait_for
from tests.unit._keys import keys
from tests.unit.test_aio_engine import make_engine

op = st.one_of(
    st.tuples(st.just("store"), st.lists(st.integers(0, 9), min_size=1, max_size=3), st.booleans()),
    st.tuples(st.just("load"), st.lists(st.integers(0, 9), min_size=1, max_size=3), st.booleans()),
    st.tuples(st.just("prepare_store"), st.lists(st.integers(0, 9), min_size=1, max_size=3)),
    st.tuples(st.just("prepare_load"), st.lists(st.integers(0, 9), min_size=1, max_size=3)),
    st.tuples(st.just("complete"), st.integers(0, 20), st.booleans()),
    st.tuples(st.just("cancel"), st.integers(0, 20)),
    st.tuples(st.just("reset")),
)


async def run_ops(ops: list[tuple]) -> None:
    handler = FakeHandler(auto=False)
    engine = make_engine(num_blocks=6, handler=handler, close_timeout_s=5)
    leases: list[tuple[str, str]] = []
    tasks: list[asyncio.Task] = []
    async with engine:
        for o in ops:
            kind = o[0]
            try:
                if kind in ("store", "load"):
                    ks = keys(*o[1])
                    handler.fail_next = 1 if o[2] else 0
                    coro = (
                        engine.store(ks, list(range(len(ks))))
                        if kind == "store"
                        else engine.load(ks, list(range(len(ks))))
                    )
                    tasks.append(asyncio.create_task(coro))
                    await asyncio.sleep(0)
                elif kind == "prepare_store":
                    lease = await engine.prepare_store(keys(*o[1]))
                    leases.append(("store", lease.lease_id))
                elif kind == "prepare_load":
                    lease = await engine.prepare_load(keys(*o[1]))
                    leases.append(("load", lease.lease_id))
                elif kind == "complete" and leases:
                    which, lease_id = leases.pop(o[1] % len(leases))
                    if which == "store":
                        await engine.complete_store(lease_id, success=o[2])
                    else:
                        await engine.complete_load(lease_id)
                elif kind == "cancel" and tasks:
                    tasks[o[1] % len(tasks)].cancel()
                elif kind == "reset":
                    handler.release()
                    await engine.reset()
                    leases.clear()
            except OffloadError:
                pass
            if len(handler.pending) > 2:
                handler.release(handler.pending[0])
        handler.fail_next = 0
        handler.release()
        handler.auto = True
        for t in tasks:
            with contextlib.suppress(OffloadError, asyncio.CancelledError):
                await t
        for which, lease_id in leases:
            if which == "store":
                await engine.complete_store(lease_id)
            else:
                await engine.complete_load(lease_id)
        # A cancelled caller's job completes in the background: wait for the poller.
        await wait_for(lambda: engine.stats().transfers_in_flight == 0)
        stats = engine.stats()
        assert stats.blocks_writing == 0, stats
        assert stats.blocks_reading == 0, stats
        # Slots of leases a reset took stay fenced for the grace period (a late sidecar
        # client may still write them); every other slot is free or holds a ready block.
        fenced = stats.blocks_fenced
        assert stats.blocks_free + stats.blocks_idle + fenced == stats.capacity_blocks


@settings(max_examples=40, deadline=None)
@given(st.lists(op, max_size=25))
def test_random_operations_leave_nothing_pinned(ops: list[tuple]) -> None:
    asyncio.run(asyncio.wait_for(run_ops(ops), 20))
