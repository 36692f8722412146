"""What one issued copy holds while it runs, pooled for reuse, and the thread that waits on it.

A copy (one job, or one batch of jobs) owns a CUDA stream, a pair of timing events and a
pinned job table with its device copy until its end event fires; :class:`CopyPools` hands
them out and takes them back, so a steady stream of jobs allocates nothing.
:class:`CompletionWatcher` sleeps in the driver until each copy's end event fires (through
its own blocking-sync event, :mod:`.end_wait`) and tells the poller, so nobody has to poll.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from kvcache_offload.dataplane.copy.kernel_issue import copy_seconds
from kvcache_offload.dataplane.copy.staged_job import StagedJob
from kvcache_offload.dataplane.handlers.cuda.end_wait import EndWait

__all__ = [
    "LANE_TABLE_ENTRIES",
    "CompletionWatcher",
    "CopyPools",
    "CopyWatch",
    "InFlightCopy",
    "LaneCopy",
    "TableSlot",
]

logger = logging.getLogger(__name__)


class TableSlot:
    """A pinned host pointer table and its device copy, owned by one job at a time."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.capacity = 0
        self.host: torch.Tensor | None = None
        self.host_np: np.ndarray | None = None
        self.dev: torch.Tensor | None = None
        self.host_ptr = 0
        self.dev_ptr = 0

    def ensure(self, entries: int, need_device: bool) -> np.ndarray:
        if entries > self.capacity:
            cap = max(entries, 3 * 4096)
            cap = 1 << (cap - 1).bit_length()
            self.host = torch.empty(cap, dtype=torch.int64, pin_memory=True)
            self.host_np = self.host.numpy()
            self.host_ptr = self.host.data_ptr()
            self.dev = None
            self.capacity = cap
        if need_device and self.dev is None:
            self.dev = torch.empty(self.capacity, dtype=torch.int64, device=self.device)
            self.dev_ptr = self.dev.data_ptr()
        assert self.host_np is not None
        return self.host_np


@dataclass
class InFlightCopy:
    jobs: list[tuple[int, int]]
    """``(job id, bytes)`` of every job this one copy carries (several when batched)."""
    stream: torch.cuda.Stream | None
    start_event: torch.cuda.Event
    end_event: torch.cuda.Event
    slot: TableSlot | None
    mechanism: str
    staged: StagedJob | None = None
    """Set for staged jobs: issued (maybe later, by the submit thread) by the copier."""
    watched: bool = False
    """Handed to the completion watcher (on-demand watching leaves it False at first)."""
    raw_start: int = 0
    raw_end: int = 0
    event_calls: tuple[int, int] | None = None
    """``cudaEventQuery`` and ``cudaEventElapsedTime`` for ``copy_seconds``: the end and the
    GPU time of a kernel copy issued from C read in one C call, with the raw events above;
    None: through torch's events (every other copy)."""

    def issued(self) -> bool:
        return self.staged is None or self.staged.issued.is_set()

    def done(self) -> bool:
        """Issued and its end event fired (a job that failed to issue is done at once)."""
        calls = self.event_calls
        if calls is not None:  # a kernel copy issued from C (never staged): one C call
            assert copy_seconds is not None
            return copy_seconds(*calls, self.raw_start, self.raw_end) >= 0
        if self.staged is not None:
            if not self.staged.issued.is_set():
                return False
            if not self.staged.end_recorded:
                return True
        return bool(self.end_event.query())

    def synchronize(self, end_wait: EndWait | None = None) -> None:
        """Return once this copy ended: asleep through ``end_wait`` where given (the copies'
        events are then not blocking-sync), else in ``end_event.synchronize()``."""
        if self.staged is not None:
            self.staged.issued.wait()
            if not self.staged.end_recorded:
                return
        if end_wait is not None:
            end_wait.wait(self.end_event)
        else:
            self.end_event.synchronize()


LANE_TABLE_ENTRIES = 16384
"""A lone-lane copy's job table (int64 entries, pinned and on the GPU): jobs of up to 8,190
units; larger ones take the general path."""


@dataclass
class LaneCopy(InFlightCopy):
    """A lone one-group kernel copy's stream, events and table, kept whole between copies:
    a lone request then takes nothing from the pools and builds nothing, and its raw
    handles are read once (:meth:`CopyLauncher.lone_units`)."""

    raw_stream: int = 0


class CompletionWatcher:
    """One thread that waits on each job's end, in submission order, and reports it.

    ``synchronize`` on a CUDA event releases the GIL, so the wait costs the event loop
    nothing; after each wait the watcher also takes every later job that has already
    finished, then calls ``callback()`` once for all of them.
    """

    def __init__(
        self, callback: Callable[[], None], name: str, end_wait: EndWait | None = None
    ) -> None:
        self._callback = callback
        self._end_wait = end_wait
        self._cond = threading.Condition()
        self._queue: deque[InFlightCopy] = deque()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, transfer: InFlightCopy) -> None:
        with self._cond:
            self._queue.append(transfer)
            self._cond.notify()

    def close(self) -> None:
        """Stop after the jobs already queued finished (they are still reported)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        try:
            self._watch_queue()
        finally:
            if self._end_wait is not None:
                self._end_wait.close()

    def _watch_queue(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                head = self._queue.popleft()
            try:
                head.synchronize(self._end_wait)
            except Exception:
                logger.exception("waiting for a transfer's end failed")
            with self._cond:
                while self._queue and _ended(self._queue[0]):
                    self._queue.popleft()
            try:
                self._callback()
            except Exception:
                logger.exception("completion callback raised; ignored")


def _ended(copy: InFlightCopy) -> bool:
    """Whether a copy the watcher holds has ended, never raising: a copy the loop already
    collected may be in use again meanwhile (a lone lane copy is reused whole, its events
    recorded anew), and reading its end and GPU time then fails ("CUDA error 600": its new
    start not reached yet). It ended, as far as this watcher goes; an error that lasts is
    met again where the copies are collected. (An H200 run lost its store watcher to this
    before: every later end was found by polls and backstops, and a stream ran 8 % slower
    with a 12 ms p99.)"""
    try:
        return copy.done()
    except Exception:
        return True


class CopyPools:
    """Streams, events and job tables of finished copies, reused by the next ones."""

    def __init__(self, device: torch.device, blocking_events: bool) -> None:
        self.device = device
        self.blocking_events = blocking_events
        self.streams: list[torch.cuda.Stream] = []
        self.timing_events: list[torch.cuda.Event] = []
        self.sync_events: list[torch.cuda.Event] = []
        self.slots: list[TableSlot] = []
        self.lane_copies: list[LaneCopy] = []

    def stream(self) -> torch.cuda.Stream:
        return self.streams.pop() if self.streams else torch.cuda.Stream(self.device)

    def slot(self) -> TableSlot:
        return self.slots.pop() if self.slots else TableSlot(self.device)

    def return_slot(self, slot: TableSlot) -> None:
        """Take back a slot that no copy used."""
        self.slots.append(slot)

    def sync_event(self) -> torch.cuda.Event:
        return self.sync_events.pop() if self.sync_events else torch.cuda.Event()

    def timing_pair(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """A copy's start and end events; the watcher sleeps on the end event."""
        pool = self.timing_events
        if len(pool) >= 2:
            return pool.pop(), pool.pop()
        blocking = self.blocking_events
        return (
            torch.cuda.Event(enable_timing=True, blocking=blocking),
            torch.cuda.Event(enable_timing=True, blocking=blocking),
        )

    def recycle(self, t: InFlightCopy) -> None:
        """Take back what a finished copy held."""
        if type(t) is LaneCopy:
            self.lane_copies.append(t)
            return
        if t.stream is not None:
            self.streams.append(t.stream)
        self.timing_events.extend((t.start_event, t.end_event))
        if t.slot is not None:
            self.return_slot(t.slot)
        if t.staged is not None and t.staged.ready_event is not None:
            self.sync_events.append(t.staged.ready_event)

    def clear(self) -> None:
        for pool in (self.streams, self.timing_events, self.sync_events):
            pool.clear()
        self.slots.clear()
        self.lane_copies.clear()


class CopyWatch:
    """Who tells the caller that copies ended: a :class:`CompletionWatcher` fed every copy as
    it is issued, or, on demand, only the copies in flight when the caller stops looking."""

    def __init__(self, name: str, end_wait: Callable[[], EndWait | None] | None = None) -> None:
        self._name = name
        self._end_wait = end_wait
        """Makes each new watcher's :class:`EndWait` (None: it sleeps on the copies'
        own blocking-sync events)."""
        self._watcher: CompletionWatcher | None = None
        self.on_demand = False

    def replace(
        self, callback: Callable[[], None] | None, in_flight: Iterable[InFlightCopy]
    ) -> CompletionWatcher | None:
        """A new watcher calling ``callback`` (None: none) over the copies in flight; returns
        the old watcher, for the caller to close outside its own lock."""
        old, self._watcher = self._watcher, None
        if callback is not None:
            end_wait = self._end_wait() if self._end_wait is not None else None
            self._watcher = CompletionWatcher(callback, self._name, end_wait)
            for t in in_flight:
                self._hand(t)
        return old

    def issued(self, t: InFlightCopy) -> None:
        if self._watcher is not None and not self.on_demand:
            self._hand(t)

    def watch_all(self, in_flight: Iterable[InFlightCopy]) -> None:
        if self._watcher is not None:
            for t in in_flight:
                if not t.watched:
                    self._hand(t)

    def _hand(self, t: InFlightCopy) -> None:
        assert self._watcher is not None
        self._watcher.watch(t)
        t.watched = True
