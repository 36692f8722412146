"""Transfer poller: turns worker jobs into asyncio futures, resolved by one task per engine.

``submit`` hands a job to the worker and returns a future. The poller task asks the worker
what finished (CUDA: ``event.query()``; CPU backend: completed thread-pool futures), runs each
job's completion callback on the loop thread, then resolves its future. The callback, not the
awaiting coroutine, releases the manager's pins: a caller cancelled while it waits leaves
nothing pinned, because the completion still runs when the copy finishes.

Handlers that know when a copy ends (:class:`~kvcache_offload.contracts.handler.NotifiesCompletion`:
the CPU backend's copy threads, the CUDA handlers' completion watcher, which sleeps in the
driver on each job's end event) wake the task. With the CUDA handlers the task also looks
for ends by itself for a while after each submission or completion (``_end_looks.py`` says
when and why). A wake costs one self-pipe write however many jobs finished together, and the
task polls again at least every ``backstop_s`` while jobs are in flight (a safety net that a
correct handler never needs).

Handlers that batch (:class:`~kvcache_offload.contracts.handler.BatchesJobs`: the CUDA handlers'
kernel and DMA paths, the CPU backend) hold the jobs submitted during one loop iteration while
copies are in flight and issue them as one copy when the iteration ends (``loop.call_soon``;
a job that finds its handler idle goes out at once): a serving engine's dozens of concurrent
small jobs then cost one launch, one end event and one wake-up per batch instead of per job.

Handlers that cannot notify are polled: with jobs in flight the task spins on
``asyncio.sleep(0)`` for up to ``spin_s`` after the last submission or completion, then
waits ``backoff_s`` at a time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from asyncio import get_running_loop
from collections.abc import Callable
from time import perf_counter

from kvcache_offload.aio._end_looks import look_closely, queued_behind
from kvcache_offload.aio._polled_job import (
    AWAIT,
    COLLECT,
    LOOK,
    OnDone,
    PolledJob,
    always,
    blocks_and_source,
)
from kvcache_offload.aio._waker import Waker
from kvcache_offload.aio.copy_clock import CopyClock
from kvcache_offload.contracts.handler import (
    TransferResult,
    TransferSpec,
)
from kvcache_offload.dataplane.handlers.router import OffloadingWorker
from kvcache_offload.errors import TransferError

__all__ = ["AWAIT", "COLLECT", "LOOK", "TransferPoller"]

logger = logging.getLogger(__name__)


class TransferPoller:
    """Owns job ids and in-flight futures for one worker; :meth:`run` is its task."""

    def __init__(
        self,
        worker: OffloadingWorker,
        *,
        spin_s: float = 0.02,
        backoff_s: float = 0.001,
        backstop_s: float = 0.01,
        completion_spin_s: float = 0.0003,
        predicted_spin_cap_s: float = 0.02,
        close_look_s: float = 2e-5,
        sleep_behind_s: float = 0.003,
        batch: bool = True,
        caller_looks: bool = False,
    ) -> None:
        self.worker = worker
        self._transfer_async = worker.transfer_async
        self.spin_s = spin_s
        self.completion_spin_s = completion_spin_s
        self.predicted_spin_cap_s = predicted_spin_cap_s
        self.close_look_s = close_look_s
        self.sleep_behind_s = sleep_behind_s
        """Stop looking while every direction with copies in flight is predicted to stay busy
        this long after its next copy ends (0: look as long as predicted; see
        :func:`~kvcache_offload.aio._end_looks.queued_behind`)."""
        self._changes = 0
        """Submissions and completions so far: ``queued_behind`` (``_end_looks.py``)
        answers again only when the jobs in flight changed."""
        self._behind_at = -1
        self._behind = False
        self.deep_sleeps = 0
        """Times the poller stopped looking because copies were queued behind the next end."""
        self.close_finds = 0
        """Jobs' ends found by a close look (see ``_end_looks.py``)."""
        self.backstop_wakes = 0
        """Sleeps on the watchers that lasted the whole ``backstop_s`` (no wake came)."""
        self.sleeps_before_flush = 0
        """Sleeps on the watchers begun while held jobs waited for this tick's flush."""
        self._copy_clock = CopyClock()
        self._look_until = 0.0
        self.backoff_s = backoff_s
        self.backstop_s = backstop_s
        self._jobs: dict[int, PolledJob] = {}
        self._next_job_id = 0
        self._waker = Waker()
        self._last_activity = 0.0
        self._drained: asyncio.Event | None = None
        self.polls = 0
        self.pushed = worker.set_completion_callback(self.wake_threadsafe)
        """True when every handler wakes the poller itself (no spinning)."""
        self.on_demand = self.pushed and completion_spin_s > 0 and worker.enable_watch_on_demand()
        """True when the handlers leave copies unwatched while the poller looks by itself
        (the CUDA handlers: their copies run on the GPU, so looking costs only the loop
        thread). Only then does the poller look for ``completion_spin_s``; the CPU
        backend's copies need the cores a looking loop would take."""
        self.batched = worker.enable_batching() if batch else False
        """True when jobs submitted in one loop tick are issued together (one copy)."""
        self._flush_scheduled = False
        self._holds_jobs: Callable[[], bool] = getattr(worker, "holds_jobs", always)
        """Whether a handler holds a job to flush (a worker that cannot say: always)."""
        self._spinning = False
        self._submitting = False
        """True while a handler is being handed a job (see :meth:`wake_threadsafe`)."""
        self._done_in_submit = False
        """The handler finished a job during :meth:`submit` and said so."""
        self._asleep = True
        """The task sleeps with nothing in flight (or has not started): a submission must
        wake it."""
        self._wake_per_job = not self.pushed or self.on_demand
        """Whether every submission wakes the task (it polls, or looks by itself), not only
        one that finds it asleep."""
        self._caller_may_look = self.on_demand and caller_looks
        """Whether the caller of a lone job looks for its end itself (see :meth:`submit_job`)."""
        self.caller_finds = 0
        """Jobs whose caller found their end itself."""

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def wake_threadsafe(self) -> None:
        """Ask the poller to look for finished jobs now; callable from any thread.

        A no-op while the poller turns the loop looking by itself: it clears the flag and
        looks once more before it sleeps, so no completion goes unseen."""
        if self._submitting and self._waker.on_loop_thread():
            # The handler finished the job it is being handed (a small copy done inline):
            # submit_job says so, and wakes the task itself unless its caller collects.
            self._done_in_submit = True
            return
        if not self._spinning:
            self._waker.wake_threadsafe()

    def submit(self, spec: TransferSpec, on_done: OnDone) -> asyncio.Future[TransferResult]:
        """Submit a job; ``on_done`` runs on the loop thread once it finished (or failed).

        Raises :class:`TransferError` if the worker refused the job; ``on_done`` is not
        called then (the caller rolls back itself).
        """
        return self.submit_job(spec, on_done, False)[0]

    def submit_job(
        self, spec: TransferSpec, on_done: OnDone, collect: bool
    ) -> tuple[asyncio.Future[TransferResult], int]:
        """:meth:`submit`, for a caller that may collect its own job; the answer's second
        item says what the caller does before awaiting the future (:data:`AWAIT`: nothing;
        with ``collect`` True also :data:`COLLECT` or :data:`LOOK`, see ``_polled_job.py``)."""
        loop = get_running_loop()
        waker = self._waker
        waker.bind(loop)
        job_id = self._next_job_id
        self._next_job_id = job_id + 1
        self._submitting = True
        try:
            submitted = self._transfer_async(job_id, spec)
        finally:
            self._submitting = False
        if not submitted:
            self._done_in_submit = False
            refusal = getattr(self.worker, "last_refusal", None)
            cause = refusal[1] if refusal is not None and refusal[0] == job_id else None
            if cause is not None:  # the error keeps it; the worker need not (its frames)
                self.worker.last_refusal = None
            raise TransferError(
                f"worker refused job {job_id} ({spec[0].medium()} -> {spec[1].medium()})"
                + (f": {cause}" if cause is not None else "")
            ) from cause
        # A job issued at once (its handler was idle) leaves nothing to flush: the flush is
        # scheduled by the first submission of the tick that a handler held. (A job done
        # during the call was not held, and its handler holds no other: it went at once.)
        done_in_submit = self._done_in_submit
        if self.batched and not self._flush_scheduled and not done_in_submit and self._holds_jobs():
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        future = loop.create_future()
        job = self._jobs[job_id] = PolledJob(future, on_done)
        if self._wake_per_job:  # only a task that polls or looks reads the time
            self._last_activity = now = perf_counter()
            if self.on_demand:  # only a poller that looks by itself predicts ends
                self._changes += 1
                job.blocks, job.source = blocks, source = blocks_and_source(spec)
                ends = self._copy_clock.expect(source, blocks, now)
                if ends > now:
                    job.ends = ends
                ends = min(ends, now + self.predicted_spin_cap_s)
                self._look_until = max(self._look_until, ends + self.completion_spin_s)
        if done_in_submit:
            self._done_in_submit = False
            # Only where the ends of later jobs are pushed: a task that looks by itself (or
            # polls) is woken as usual, so a callback that came for another reason can never
            # leave a job unwatched.
            if collect and not self._wake_per_job:
                return future, COLLECT
            self._asleep = False  # the swallowed announcement's wake-up, as it would have
            waker.wake()
            return future, AWAIT
        if collect and self._caller_may_look and self._asleep and len(self._jobs) == 1:
            return future, LOOK  # the task sleeps on: nothing else is in flight
        if self._asleep or self._wake_per_job:
            # A task that sleeps with jobs in flight is woken by their ends (or its
            # backstop), so only an idle one needs this job's wake-up; one that looks by
            # itself or polls hears of every job.
            self._asleep = False
            waker.wake()
        return future, AWAIT

    def lone_in_flight(self) -> bool:
        """Whether exactly one job is in flight (the caller's own, just submitted): the loop
        has nothing else to do while its copy runs."""
        return len(self._jobs) == 1

    def caller_look(self) -> bool:
        """One look by the caller of a :data:`LOOK` job: collect what finished (closely when
        its end is predicted within ``close_look_s``). True: look again after one loop turn;
        False: stop (jobs finished, or nothing is predicted to end before the looking window
        closes: the task then sleeps on the watchers as it would have)."""
        if self.poll_once() or look_closely(self):
            self.caller_finds += 1
            return False
        return bool(self._jobs) and time.perf_counter() < self._look_until

    def caller_stop(self, future: asyncio.Future[TransferResult]) -> None:
        """The caller of a :data:`LOOK` job stopped looking: a job still in flight goes back
        to the task, woken whatever it does (one sleeping on the watchers was not handed
        this job's copy, issued unwatched, and would find it only at its backstop)."""
        if not future.done() and self._jobs:
            self._asleep = False
            self._waker.wake()

    def _flush(self) -> None:
        """Issue what the handlers held this tick: runs once per loop iteration with jobs
        submitted, after every coroutine that was ready in that iteration submitted its own."""
        self._flush_scheduled = False
        self.worker.flush()

    def poll_once(self) -> int:
        """Collect finished jobs, run their callbacks, resolve their futures; returns count."""
        self.polls += 1
        try:
            results = self.worker.get_finished()
        except Exception:
            logger.exception("worker.get_finished() raised; will retry")
            return 0
        if not results:
            return 0
        self._changes += 1
        jobs = self._jobs
        for result in results:
            job = jobs.pop(result.job_id, None)
            if job is None:
                logger.warning("worker reported unknown job %d", result.job_id)
                continue
            if job.blocks and len(results) == 1 and result.transfer_time:
                # Jobs that end together may have shared one copy (a batch), whose time
                # each reports: only a lone end times one job's blocks.
                self._copy_clock.observe(job.source, job.blocks, result.transfer_time)
            # Run the callback, then resolve the future (inline: one call less per job).
            future = job.future
            try:
                job.on_done(result)
            except Exception as exc:
                logger.exception("completion of job %d failed", result.job_id)
                if not future.done():
                    future.set_exception(exc)
                continue
            if not future.done():  # the awaiting coroutine may have been cancelled
                future.set_result(result)
        if self._wake_per_job:  # only a task that polls or looks reads the time
            self._last_activity = now = perf_counter()
            if self.on_demand:  # only a poller that looks by itself predicts or looks on
                self._look_until = max(self._look_until, now + self.completion_spin_s)
        if not jobs:
            if self.on_demand:
                self._copy_clock.idle()
            if self._drained is not None:
                self._drained.set()
        return len(results)

    collect_now = poll_once
    """Collect what finished, on the caller's turn (see :meth:`submit_job`)."""

    def _completion_fd_ready(self, fd: int) -> None:
        """A handler's copy thread announced an end on its descriptor: clear it, look."""
        try:
            os.read(fd, 8)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:  # closed under us (shutdown): stop watching it
            asyncio.get_running_loop().remove_reader(fd)
        self._waker.wake()

    async def run(self) -> None:
        """The poller task: runs until cancelled."""
        loop = asyncio.get_running_loop()
        self._waker.bind(loop)
        fds = self.worker.completion_fds()
        for fd in fds:
            loop.add_reader(fd, self._completion_fd_ready, fd)
        try:
            await self._run()
        finally:
            for fd in fds:
                loop.remove_reader(fd)

    async def _run(self) -> None:
        while True:
            if not self._jobs:
                self._spinning = False
                self._asleep = True
                await self._waker.wait()
                self._asleep = False
                continue
            if self.pushed:
                self._spinning = self.on_demand
                if self.poll_once() or (self.on_demand and look_closely(self)):
                    if not self._jobs:
                        # Nothing in flight: sleep on the waker (the resumed coroutines run
                        # meanwhile). A job that its caller collects itself (see
                        # submit_job) then costs this task no turn at all.
                        continue
                    await asyncio.sleep(0)  # let the resumed coroutines run first
                elif self.on_demand and time.perf_counter() < self._look_until:
                    # A copy in flight should end soon (moments after the last submission
                    # or completion, or within its predicted duration): one loop iteration
                    # is far cheaper than the watcher's wake-up, which on the H200 host
                    # took ~70-640 us after a long sleep in the driver. Not while copies
                    # are queued behind every next end: the link stays busy meanwhile.
                    if not (self.sleep_behind_s and queued_behind(self)):
                        await asyncio.sleep(0)
                        continue
                    self.deep_sleeps += 1
                    await self._sleep_on_watchers()
                else:
                    await self._sleep_on_watchers()
            elif self.poll_once():
                await asyncio.sleep(0)  # let the resumed coroutines run before polling again
            elif time.perf_counter() - self._last_activity < self.spin_s:
                await asyncio.sleep(0)
            else:
                await self._waker.wait(self.backoff_s)

    async def _sleep_on_watchers(self) -> None:
        """Stop looking: hand the copies in flight to the watchers and sleep until one
        wakes the task (or a submission, or the backstop)."""
        self._spinning = False
        # A copy that ended while the watchers' wakes were off is seen here.
        if self.on_demand:
            self.worker.watch_in_flight()
            if self.poll_once():
                return
        if self._flush_scheduled:
            self.sleeps_before_flush += 1
        began = perf_counter()
        await self._waker.wait(self.backstop_s)
        if perf_counter() - began >= self.backstop_s:
            self.backstop_wakes += 1

    async def drain(self, timeout: float | None = None) -> bool:
        """Wait until no job is in flight (the poller must be running); False on timeout."""
        while self._jobs:
            self._drained = asyncio.Event()
            self._waker.wake()
            try:
                await asyncio.wait_for(self._drained.wait(), timeout)
            except TimeoutError:
                return False
            finally:
                self._drained = None
        return True

    def fail_all(self, reason: str) -> int:
        """Fail every in-flight job without running its callback (shutdown after a timeout)."""
        jobs, self._jobs = self._jobs, {}
        for job in jobs.values():
            if not job.future.done():
                job.future.set_exception(TransferError(reason))
        return len(jobs)
