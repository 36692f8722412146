"""LeaseTable expiry and TransferPoller resolution, in isolation."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from kvcache_offload import CPULoadStoreSpec, GPULoadStoreSpec, ReqContext
from kvcache_offload.aio import LeaseTable, TransferPoller
from kvcache_offload.contracts.handler import TransferResult, TransferSpec
from kvcache_offload.dataplane.handlers.router import OffloadingWorker
from kvcache_offload.errors import ConfigError, LeaseError, TransferError
from tests.unit._aio_fakes import FakeHandler, wait_for
from tests.unit._keys import keys


async def test_lease_pop_returns_it_once_then_raises_lease_error() -> None:
    table = LeaseTable(lambda lease: None, default_ttl_s=10)
    lease = table.add("store", keys(1), [0], ReqContext())
    assert table.pop(lease.lease_id, "store") is lease
    with pytest.raises(LeaseError, match="unknown or already completed"):
        table.pop(lease.lease_id, "store")


async def test_lease_of_other_kind_is_not_found() -> None:
    table = LeaseTable(lambda lease: None, default_ttl_s=10)
    lease = table.add("load", keys(1), [0], ReqContext())
    with pytest.raises(LeaseError):
        table.pop(lease.lease_id, "store")
    assert len(table) == 1


async def test_reaper_expires_leases_and_reports_expired_on_late_completion() -> None:
    expired = []
    table = LeaseTable(expired.append, default_ttl_s=10)
    reaper = asyncio.create_task(table.run())
    try:
        short = table.add("store", keys(1), [0], ReqContext(), ttl_s=0.02)
        long = table.add("load", keys(2), [1], ReqContext())
        await wait_for(lambda: expired)
        assert expired == [short]
        assert table.expired == {"store": 1, "load": 0}
        with pytest.raises(LeaseError, match="expired"):
            table.pop(short.lease_id, "store")
        assert table.pop(long.lease_id, "load") is long
    finally:
        reaper.cancel()


async def test_non_positive_ttl_is_rejected() -> None:
    table = LeaseTable(lambda lease: None, default_ttl_s=1)
    with pytest.raises(ConfigError):
        table.add("store", keys(1), [0], ReqContext(), ttl_s=0)


def _worker(handler: FakeHandler) -> OffloadingWorker:
    worker = OffloadingWorker()
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, handler)
    return worker


SPEC = (GPULoadStoreSpec([1], [1], [0]), CPULoadStoreSpec([0]))


async def test_poller_resolves_futures_after_running_the_completion() -> None:
    handler = FakeHandler(auto=False)
    poller = TransferPoller(_worker(handler))
    task = asyncio.create_task(poller.run())
    order: list[str] = []
    try:
        fut = poller.submit(SPEC, lambda r: order.append("done"))
        fut.add_done_callback(lambda f: order.append("resolved"))
        assert poller.in_flight == 1
        handler.release()
        result = await asyncio.wait_for(fut, 2)
        assert isinstance(result, TransferResult) and result.success
        assert order == ["done", "resolved"]
        assert poller.in_flight == 0
    finally:
        task.cancel()


async def test_poller_runs_the_completion_even_if_the_awaiter_was_cancelled() -> None:
    handler = FakeHandler(auto=False)
    poller = TransferPoller(_worker(handler))
    task = asyncio.create_task(poller.run())
    done: list[TransferResult] = []
    try:
        fut = poller.submit(SPEC, done.append)
        waiter = asyncio.create_task(asyncio.wait_for(fut, 10))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        handler.release()
        await wait_for(lambda: done)
        assert done[0].success
    finally:
        task.cancel()


async def test_refused_submission_raises_transfer_error_without_a_job() -> None:
    handler = FakeHandler()
    handler.refuse = True
    poller = TransferPoller(_worker(handler))
    with pytest.raises(TransferError):
        poller.submit(SPEC, lambda r: None)
    assert poller.in_flight == 0


async def test_idle_poller_does_not_poll() -> None:
    handler = FakeHandler()
    poller = TransferPoller(_worker(handler))
    task = asyncio.create_task(poller.run())
    try:
        for _ in range(50):
            await asyncio.sleep(0)
        assert poller.polls == 0
        fut = poller.submit(SPEC, lambda r: None)
        await asyncio.wait_for(fut, 2)
        polls = poller.polls
        for _ in range(50):
            await asyncio.sleep(0)
        assert poller.polls == polls  # back to sleeping once nothing is in flight
    finally:
        task.cancel()


async def test_thread_wakeup_resolves_a_job_after_the_spin_window() -> None:
    handler = FakeHandler(auto=False)
    poller = TransferPoller(_worker(handler), spin_s=0.0, backoff_s=30.0)
    task = asyncio.create_task(poller.run())
    try:
        fut = poller.submit(SPEC, lambda r: None)
        await wait_for(lambda: poller.polls >= 1)

        def finish() -> None:
            handler.release()
            poller.wake_threadsafe()

        await asyncio.to_thread(finish)
        await asyncio.wait_for(fut, 2)  # would take 30 s without the wake-up
    finally:
        task.cancel()


async def test_leases_that_hold_nothing_are_not_kept_and_complete_as_no_ops() -> None:
    from kvcache_offload.aio import OffloadEngine
    from tests.unit._aio_fakes import FakeSpec, small_config

    config = small_config(4, max_open_leases=2)
    async with OffloadEngine(config, spec=FakeSpec(config)) as engine:
        for _ in range(1000):  # e.g. 20,000 prepares of nothing with ttl_s 3600
            empty = await engine.prepare_store([], ttl_s=3600)
            assert engine.stats().leases_active == 0
        assert await engine.complete_store(empty.lease_id) == []


async def test_open_leases_are_capped_with_a_lease_limit_error() -> None:
    from kvcache_offload.aio import OffloadEngine
    from kvcache_offload.errors import LeaseLimitError
    from tests.unit._aio_fakes import FakeSpec, small_config
    from tests.unit._keys import keys

    config = small_config(8, max_open_leases=2)
    async with OffloadEngine(config, spec=FakeSpec(config)) as engine:
        first = await engine.prepare_store(keys(1))
        await engine.prepare_load([], ttl_s=5)  # holds nothing: not counted
        await engine.prepare_store(keys(2))
        with pytest.raises(LeaseLimitError, match="max_open_leases=2"):
            await engine.prepare_store(keys(3))
        await engine.complete_store(first.lease_id)
        await engine.prepare_store(keys(3))


class NotifyingHandler(FakeHandler):
    """A fake that reports completions through a callback, as the real handlers do, and has
    nothing to defer when the poller looks by itself (on-demand watching is a no-op)."""

    def __init__(self) -> None:
        super().__init__(auto=False)
        self.callback: Callable[[], None] | None = None

    def set_completion_callback(self, callback: Callable[[], None] | None) -> None:
        self.callback = callback

    def set_watch_on_demand(self, enabled: bool) -> None:
        pass  # completes on its own: nothing to defer

    def watch_in_flight(self) -> None:
        pass


class PushingHandler(NotifyingHandler):
    """Releases each job from a thread after a delay and then calls the completion callback,
    the way the CUDA handlers' watcher and the CPU backend's copy thread do."""

    def __init__(self, delays_s: list[float]) -> None:
        super().__init__()
        self.delays_s = delays_s
        self.threads: list[threading.Thread] = []

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        super().transfer_async(job_id, spec)
        delay = self.delays_s[job_id % len(self.delays_s)]

        def finish() -> None:
            time.sleep(delay)
            self.release(job_id)
            if self.callback is not None:
                self.callback()

        thread = threading.Thread(target=finish, daemon=True)
        thread.start()
        self.threads.append(thread)
        return True


async def test_pushed_completions_around_the_spin_window_are_never_lost() -> None:
    # Completions land before, at and after the spin window, and the backstop is far away:
    # a completion whose wake was skipped while the poller looked by itself, and that it
    # missed on its last look, would leave its job waiting for the 30 s backstop.
    delays = [0.0, 0.0001, 0.0003, 0.0005, 0.001, 0.003]
    handler = PushingHandler(delays)
    poller = TransferPoller(_worker(handler), backstop_s=30.0, completion_spin_s=0.0003)
    assert poller.pushed
    task = asyncio.create_task(poller.run())
    try:
        for round_ in range(20):
            futures = [poller.submit(SPEC, lambda r: None) for _ in range(round_ % 4 + 1)]
            results = await asyncio.wait_for(asyncio.gather(*futures), 5)
            assert all(r.success for r in results)
            await asyncio.sleep(delays[round_ % len(delays)])  # let the poller go to sleep
        assert poller.in_flight == 0
    finally:
        task.cancel()
        for thread in handler.threads:
            thread.join()


class EndsDuringTheLook(NotifyingHandler):
    """The copy ends right after ``get_finished`` looked and saw nothing: the worst moment
    for a skipped wake-up (deterministic, unlike a thread racing the poller)."""

    def get_finished(self) -> list[TransferResult]:
        out = super().get_finished()
        if not out and self.pending and self.pending[0] not in self.released:
            self.release()
            if self.callback is not None:
                self.callback()
        return out


async def test_a_copy_ending_during_the_last_look_before_sleeping_is_seen() -> None:
    handler = EndsDuringTheLook()
    poller = TransferPoller(_worker(handler), backstop_s=30.0, completion_spin_s=1e-9)
    assert poller.on_demand
    task = asyncio.create_task(poller.run())
    try:
        for _ in range(5):
            fut = poller.submit(SPEC, lambda r: None)
            assert (await asyncio.wait_for(fut, 5)).success  # not after the 30 s backstop
    finally:
        task.cancel()


class WatchedOnlyWhenAsked(NotifyingHandler):
    """A copy ends only once watched (``slow``), or on the first look (fast): the CUDA
    handlers' on-demand watching, without a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.on_demand = False
        self.slow = False
        self.watch_calls = 0
        self.threads: list[threading.Thread] = []

    def set_watch_on_demand(self, enabled: bool) -> None:
        self.on_demand = enabled

    def watch_in_flight(self) -> None:
        self.watch_calls += 1
        pending = list(self.pending)

        def watch() -> None:
            time.sleep(0.01)
            for job_id in pending:
                self.release(job_id)
            if self.callback is not None:
                self.callback()

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        self.threads.append(thread)

    def get_finished(self) -> list[TransferResult]:
        if not self.slow:
            self.release()
        return super().get_finished()


async def test_copies_are_watched_only_once_the_poller_stops_looking() -> None:
    handler = WatchedOnlyWhenAsked()
    poller = TransferPoller(_worker(handler), backstop_s=30.0, completion_spin_s=0.0003)
    assert handler.on_demand and poller.on_demand
    task = asyncio.create_task(poller.run())
    try:
        for _ in range(10):  # ends on the first look: no watcher involved
            assert (await asyncio.wait_for(poller.submit(SPEC, lambda r: None), 5)).success
        assert handler.watch_calls == 0
        handler.slow = True  # outlasts the window: watched, then reported by the callback
        assert (await asyncio.wait_for(poller.submit(SPEC, lambda r: None), 5)).success
        assert handler.watch_calls >= 1
    finally:
        task.cancel()
        for thread in handler.threads:
            thread.join()


class _FdHandler(FakeHandler):
    """Announces ends only on a descriptor (as the native copy queue does), never by callback."""

    def __init__(self) -> None:
        super().__init__(auto=False)
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)

    def set_completion_callback(self, callback: Callable[[], None] | None) -> None:
        pass  # ends are announced on the descriptor only

    def completion_fd(self) -> int | None:
        return self.read_fd

    def end_all(self) -> None:
        self.release()
        os.write(self.write_fd, b"\x01")


async def test_poller_wakes_on_a_handlers_completion_descriptor() -> None:
    handler = _FdHandler()
    # A backstop of a minute: only the descriptor can wake the poller within the test.
    poller = TransferPoller(_worker(handler), backstop_s=60.0)
    assert poller.pushed
    task = asyncio.create_task(poller.run())
    loop = asyncio.get_running_loop()
    try:
        fut = poller.submit(SPEC, lambda r: None)
        await asyncio.sleep(0.05)  # the poller is asleep now
        assert not fut.done()
        loop.call_later(0.01, handler.end_all)
        result = await asyncio.wait_for(fut, 5)
        assert result.success
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    # Stopping the poller stops watching the descriptor.
    assert not loop.remove_reader(handler.read_fd)
    os.close(handler.read_fd)
    os.close(handler.write_fd)


class TimedCopies(WatchedOnlyWhenAsked):
    """Each copy takes ``seconds`` from its submission and reports that GPU time; watching
    it (the driver's sleep) is counted, and still ends it."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.slow = True
        self.seconds = seconds
        self.started: dict[int, float] = {}

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        self.started[job_id] = time.perf_counter()
        return super().transfer_async(job_id, spec)

    def get_finished(self) -> list[TransferResult]:
        now = time.perf_counter()
        for job_id in list(self.pending):
            if now - self.started[job_id] >= self.seconds:
                self.release(job_id)
        return [
            TransferResult(r.job_id, r.success, r.transfer_size, self.seconds, r.transfer_type)
            for r in super().get_finished()
        ]


@contextlib.asynccontextmanager
async def _polling(handler: TimedCopies, **kw: Any) -> AsyncIterator[TransferPoller]:
    """A running poller over ``handler`` (backstop 30 s: a missed end would hang)."""
    poller = TransferPoller(_worker(handler), backstop_s=30.0, **kw)
    task = asyncio.create_task(poller.run())
    try:
        yield poller
    finally:
        task.cancel()
        for thread in handler.threads:
            thread.join()


async def _one_job(poller: TransferPoller) -> TransferResult:
    result = await asyncio.wait_for(poller.submit(SPEC, lambda r: None), 5)
    assert result.success
    return result


async def test_a_copy_of_predictable_length_is_seen_by_looking_not_by_the_watcher() -> None:
    # Copies of 60 ms, far past the 20 ms look after a submission: the first one, with
    # nothing measured yet, goes to the watcher; later ones end within their predicted
    # length (plus the same 20 ms of slack, ample for a busy host's scheduling), so the
    # poller keeps looking and never pays the driver's wake-up.
    handler = TimedCopies(0.06)
    async with _polling(handler, completion_spin_s=0.02, predicted_spin_cap_s=0.2) as poller:
        await _one_job(poller)
        first_watches = handler.watch_calls
        assert first_watches >= 1
        for _ in range(5):
            await _one_job(poller)
        assert handler.watch_calls == first_watches


async def test_a_prediction_is_capped() -> None:
    # A copy predicted to take 50 ms is looked for only up to the cap, then watched (each
    # one at least once; uncapped, only the first would be).
    handler = TimedCopies(0.05)
    async with _polling(handler, completion_spin_s=0.0003, predicted_spin_cap_s=0.005) as poller:
        for _ in range(3):
            await _one_job(poller)
        assert handler.watch_calls >= 3


async def test_a_lone_copy_about_to_end_is_found_by_a_close_look() -> None:
    # 5 ms copies and a 20 ms close look: once a copy's length is known, the poller looks
    # for the next lone copy's end without turning the loop, and still reports it exactly.
    handler = TimedCopies(0.005)
    async with _polling(handler, completion_spin_s=0.02, close_look_s=0.02) as poller:
        for _ in range(4):
            assert (await _one_job(poller)).transfer_time == 0.005
        assert poller.close_finds >= 1
        assert poller.in_flight == 0


async def _together(poller: TransferPoller, n: int) -> None:
    """``n`` jobs submitted in one go, all awaited (each must succeed)."""
    futures = [poller.submit(SPEC, lambda r: None) for _ in range(n)]
    results = await asyncio.wait_for(asyncio.gather(*futures), 5)
    assert all(r.success for r in results)


async def test_copies_queued_behind_the_next_end_are_left_to_the_watcher() -> None:
    # 100 ms copies: once their length is known, three submitted together are predicted to
    # end 100, 200 and 300 ms out, so 200 ms of copying is queued behind the next end (the
    # poller's first look comes long before any of them ends, even on a loaded machine).
    # With a 5 ms threshold the poller stops looking and hands them to the watcher; a lone
    # copy after them is looked for again (its end is what its caller waits on).
    handler = TimedCopies(0.1)
    async with _polling(
        handler, completion_spin_s=0.02, predicted_spin_cap_s=0.5, sleep_behind_s=0.005
    ) as poller:
        await _one_job(poller)  # nothing measured yet: watched
        await _one_job(poller)  # measured now: looked for
        watched = handler.watch_calls
        assert poller.deep_sleeps == 0
        await _together(poller, 3)
        assert poller.deep_sleeps >= 1
        assert handler.watch_calls > watched
        watched, sleeps = handler.watch_calls, poller.deep_sleeps
        await _one_job(poller)
        assert (handler.watch_calls, poller.deep_sleeps) == (watched, sleeps)
        assert poller.in_flight == 0


async def test_without_the_threshold_queued_copies_are_looked_for() -> None:
    handler = TimedCopies(0.1)
    async with _polling(
        handler, completion_spin_s=0.02, predicted_spin_cap_s=0.5, sleep_behind_s=0.0
    ) as poller:
        await _one_job(poller)
        watched = handler.watch_calls
        await _together(poller, 3)
        assert (handler.watch_calls, poller.deep_sleeps) == (watched, 0)


class SilentWatchers(TimedCopies):
    """Copies whose watchers never call back: only a look or the backstop finds their end."""

    def watch_in_flight(self) -> None:
        self.watch_calls += 1


async def test_an_end_no_watcher_announced_is_found_at_the_backstop_and_counted() -> None:
    # The backstop is the safety net behind the watchers; a sleep that lasted all of it is
    # counted (bench.serving reports it), so a lost wake-up shows in the numbers.
    handler = SilentWatchers(0.03)
    poller = TransferPoller(_worker(handler), backstop_s=0.05, completion_spin_s=0.0003)
    task = asyncio.create_task(poller.run())
    try:
        assert (await asyncio.wait_for(poller.submit(SPEC, lambda r: None), 5)).success
        assert handler.watch_calls >= 1 and poller.backstop_wakes >= 1
    finally:
        task.cancel()


async def test_an_end_a_watcher_announced_is_no_backstop_wake() -> None:
    handler = WatchedOnlyWhenAsked()
    handler.slow = True
    poller = TransferPoller(_worker(handler), backstop_s=30.0, completion_spin_s=0.0003)
    task = asyncio.create_task(poller.run())
    try:
        assert (await asyncio.wait_for(poller.submit(SPEC, lambda r: None), 5)).success
        assert handler.watch_calls >= 1 and poller.backstop_wakes == 0
    finally:
        task.cancel()
        for thread in handler.threads:
            thread.join()
