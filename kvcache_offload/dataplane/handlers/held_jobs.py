"""Jobs a batching handler holds until the end of the loop iteration, then issues as one copy.

Both the CUDA handlers and the CPU backend batch (see ``BatchesJobs`` in the handler
contract); this is the state they share: the held jobs in submission order, their ids (a
resubmitted id is refused), their bytes (a batch goes out early once it is large) and,
where one copy may write its blocks in any order, the destination blocks they write.
"""

from __future__ import annotations

import threading
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from kvcache_offload.dataplane.copy.plan import TransferPlan

__all__ = ["BatchingSwitch", "HeldJobs", "MarkedHeldJobs", "SizedJob"]


class SizedJob(Protocol):
    """What a held job must say of itself: its bytes (a :class:`TransferPlan`, or a lighter
    record of a handler's own)."""

    @property
    def num_bytes(self) -> int: ...


J = TypeVar("J", bound=SizedJob)


class HeldJobs(Generic[J]):
    """The jobs of the batch being gathered; not thread-safe (the handler's lock guards it)."""

    def __init__(self) -> None:
        self.jobs: list[tuple[int, J]] = []
        self.ids: set[int] = set()
        """The held jobs' ids (a handler checks a new job against them without a call)."""
        self._dst: set[int] = set()
        self.nbytes = 0

    def __bool__(self) -> bool:
        return bool(self.jobs)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self.ids

    def add(self, job_id: int, job: J, dst_blocks: set[int] | None = None) -> None:
        self.jobs.append((job_id, job))
        self.ids.add(job_id)
        self.nbytes += job.num_bytes
        if dst_blocks:
            self._dst |= dst_blocks

    def writes_any(self, dst_blocks: set[int]) -> bool:
        """Whether a held job writes one of ``dst_blocks`` (then a later job must wait)."""
        return not self._dst.isdisjoint(dst_blocks)

    def take(self) -> list[tuple[int, J]]:
        """The held jobs, oldest first; the batch starts over empty."""
        jobs = self.jobs
        self.jobs, self.ids, self._dst, self.nbytes = [], set(), set(), 0
        return jobs

    @staticmethod
    def merged(jobs: list[tuple[int, TransferPlan]]) -> TransferPlan:
        """One plan copying every job's fragments in submission order."""
        return jobs[0][1] if len(jobs) == 1 else TransferPlan.merge([p for _, p in jobs])


class MarkedHeldJobs(HeldJobs[J]):
    """:class:`HeldJobs` whose destination blocks can also be marks in an array, one entry
    per block of the destination side: ``marks[b] == mark`` when a held job writes block
    ``b``. The host-copy extension's ``hold_units`` checks and marks a job's blocks in the
    same C call that writes its units (the CUDA handlers), and :meth:`add_marked` holds such
    a job. Jobs held with a set of blocks (:meth:`add`) keep the set check, and are marked
    only when a C call asks for the marks (:meth:`current_marks`): a batch of planned jobs
    (a mixed stream's staged ones) pays nothing for the array. A new batch takes a new mark,
    so nothing is cleared between batches."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__()
        self.marks = np.zeros(max(num_blocks, 1), dtype=np.int64)
        self.mark = 1
        self._unmarked: list[set[int]] = []
        """Block sets of jobs held by :meth:`add` and not yet in ``marks``."""
        self._any_marked = False
        """Whether a job of this batch was held by :meth:`add_marked` (blocks only marked)."""

    def add(self, job_id: int, job: J, dst_blocks: set[int] | None = None) -> None:
        super().add(job_id, job, dst_blocks)
        if dst_blocks:
            self._unmarked.append(dst_blocks)

    def add_marked(self, job_id: int, job: J) -> None:
        """Hold a job whose blocks ``hold_units`` marked already (in :meth:`current_marks`)."""
        super().add(job_id, job)  # no set: its blocks are only in the marks
        self._any_marked = True

    def current_marks(self) -> tuple[np.ndarray, int]:
        """``(marks, mark)`` with the blocks of every held job marked, for a C call."""
        if self._unmarked:
            marks, mark = self.marks, self.mark
            for blocks in self._unmarked:
                marks[np.fromiter(blocks, np.int64, len(blocks))] = mark
            self._unmarked.clear()
        return self.marks, self.mark

    def writes_any(self, dst_blocks: set[int]) -> bool:
        if super().writes_any(dst_blocks):
            return True
        if not self._any_marked or not dst_blocks:
            return False
        marks, mark = self.marks, self.mark
        if len(dst_blocks) <= 8:  # a serving job's few blocks: no array built
            return any(marks[b] == mark for b in dst_blocks)
        blocks = np.fromiter(dst_blocks, np.int64, len(dst_blocks))
        return bool((marks[blocks] == mark).any())

    def take(self) -> list[tuple[int, J]]:
        self.mark += 1
        self._unmarked.clear()
        self._any_marked = False
        return super().take()


class BatchingSwitch:
    """``set_batching`` and ``flush`` (the ``BatchesJobs`` capability) over a handler's held
    jobs; the handler says whether it can batch at all and how it issues what it held."""

    _held: HeldJobs[Any]
    _lock: threading.Lock
    _batching: bool

    def _can_hold_jobs(self) -> bool:
        return True

    def _flush_locked(self) -> None:
        raise NotImplementedError

    def set_batching(self, enabled: bool) -> None:
        """Hold jobs until :meth:`flush` (the caller promises to call it soon, e.g. once per
        event-loop tick) and issue those held as one copy; jobs still complete in submission
        order, and a later job still wins over an earlier one writing the same block."""
        if not self._can_hold_jobs():
            return
        if not enabled:
            self.flush()
        self._batching = enabled

    def holds_jobs(self) -> bool:
        """Whether a job is held, i.e. whether :meth:`flush` would issue anything."""
        return bool(self._held.jobs)

    def held_jobs(self) -> HeldJobs[Any]:
        """The batch being gathered (the same object for the handler's lifetime), for a
        caller that asks :meth:`holds_jobs` per submission without a call per handler."""
        return self._held

    def flush(self) -> None:
        """Issue the held jobs now (a no-op when none is held)."""
        if self._held:
            with self._lock:
                self._flush_locked()
