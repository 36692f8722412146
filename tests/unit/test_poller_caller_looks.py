"""A lone job's caller looks for its copy's end itself (the CUDA handlers' looking poller).

With copies that end on the GPU, the poller task looks for ends by itself; for a job alone
in flight, :meth:`TransferPoller.submit_job` lets its caller do that looking instead, so the
result is ready when the caller awaits it. These tests check, with fake handlers, that such
a job is found on the caller's own turn, that other jobs still wake the task, and that a
caller who stops looking (cancelled, or past the looking window) hands its job back to the
task: no end is ever missed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvcache_offload.aio.poller import AWAIT, LOOK, TransferPoller
from kvcache_offload.contracts.handler import TransferResult
from tests.unit.test_aio_leases_poller import SPEC, TimedCopies, _worker


@contextlib.asynccontextmanager
async def _poller(handler: TimedCopies, **kw: Any) -> AsyncIterator[TransferPoller]:
    """A running poller over ``handler`` whose task has gone to sleep (backstop 30 s: a
    missed end would hang the test)."""
    kw.setdefault("caller_looks", True)
    poller = TransferPoller(_worker(handler), backstop_s=30.0, **kw)
    task = asyncio.create_task(poller.run())
    await asyncio.sleep(0.01)
    try:
        yield poller
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for thread in handler.threads:
            thread.join()


async def _look(poller: TransferPoller, future: asyncio.Future[TransferResult]) -> bool:
    """The caller's side of a LOOK job; True when it found the end itself."""
    found = False
    try:
        while not future.done():
            if not poller.caller_look():
                found = future.done()
                break
            await asyncio.sleep(0)
    finally:
        poller.caller_stop(future)
    return found


async def test_a_lone_jobs_caller_finds_the_end_itself() -> None:
    handler = TimedCopies(0.002)
    async with _poller(handler, completion_spin_s=0.05) as poller:
        for _ in range(5):
            done: list[TransferResult] = []
            future, mode = poller.submit_job(SPEC, done.append, True)
            assert mode == LOOK
            assert await _look(poller, future)  # resolved by the caller's own look
            assert done == [future.result()] and future.result().success
        assert poller.caller_finds == 5 and poller.in_flight == 0
        assert handler.watch_calls == 0  # nobody slept on the driver


async def test_a_job_submitted_while_a_caller_looks_wakes_the_task() -> None:
    handler = TimedCopies(0.003)
    async with _poller(handler, completion_spin_s=0.05) as poller:
        first, mode = poller.submit_job(SPEC, lambda r: None, True)
        assert mode == LOOK
        second, other = poller.submit_job(SPEC, lambda r: None, True)
        assert other == AWAIT  # not alone: the task looks for it as before
        await _look(poller, first)
        results = await asyncio.wait_for(asyncio.gather(first, second), 5)
        assert all(r.success for r in results) and poller.in_flight == 0


async def test_a_cancelled_caller_hands_its_job_back_and_nothing_is_lost() -> None:
    handler = TimedCopies(0.02)
    async with _poller(handler, completion_spin_s=0.05) as poller:
        done: list[TransferResult] = []
        future, mode = poller.submit_job(SPEC, done.append, True)
        assert mode == LOOK
        looker = asyncio.create_task(_look(poller, future))
        await asyncio.sleep(0.002)
        looker.cancel()
        with pytest.raises(asyncio.CancelledError):
            await looker
        assert not future.done()
        result = await asyncio.wait_for(future, 5)  # the task completed it
        assert result.success and done == [result]


async def test_a_caller_past_the_looking_window_leaves_the_job_to_the_watchers() -> None:
    # A copy far longer than the window after its submission, with nothing measured to
    # predict it: the caller stops looking, and the task hands the copy to the watchers.
    handler = TimedCopies(0.05)
    async with _poller(handler, completion_spin_s=0.001, predicted_spin_cap_s=0.001) as poller:
        future, mode = poller.submit_job(SPEC, lambda r: None, True)
        assert mode == LOOK
        assert not await _look(poller, future)
        assert (await asyncio.wait_for(future, 5)).success
        assert handler.watch_calls >= 1 and poller.caller_finds == 0


async def test_callers_do_not_look_when_turned_off() -> None:
    handler = TimedCopies(0.001)
    async with _poller(handler, completion_spin_s=0.05, caller_looks=False) as poller:
        future, mode = poller.submit_job(SPEC, lambda r: None, True)
        assert mode == AWAIT
        assert (await asyncio.wait_for(future, 5)).success
        assert poller.caller_finds == 0


async def test_a_caller_whose_copy_is_done_at_once_still_yields_to_the_others() -> None:
    # A copy done by the first look must not let its caller run on without yielding: every
    # await of a job gives the other coroutines a turn, as the future's await always did.
    from kvcache_offload.aio.engine_jobs import _settle

    handler = TimedCopies(0.0)
    async with _poller(handler, completion_spin_s=0.05) as poller:
        for _ in range(3):
            others: list[int] = []
            asyncio.get_running_loop().call_soon(others.append, 1)
            future, mode = poller.submit_job(SPEC, lambda r: None, True)
            assert mode == LOOK
            await _settle(poller, future, mode)
            assert future.done() and others == [1]
        assert poller.caller_finds == 3
