"""A direction's host copies run by a native thread that never takes the GIL.

A Python copy thread needs the GIL after every copy, to mark it done and to wake the event
loop; while the loop thread runs Python, it gets it back only at the interpreter's next
switch (up to 5 ms later), so under load the copies wait on the loop instead of overlapping
it. :class:`HostCopyQueue` hands each job's units to the C extension's ``CopyQueue``: its
thread copies, appends the job to a finished list and signals a file descriptor, all without
the GIL. The loop watches that descriptor (the poller's ``add_reader``) and collects finished
jobs with one call. Jobs run strictly in submission order, like the Python thread's.
"""

from __future__ import annotations

import numpy as np

from kvcache_offload.dataplane.copy.host_copy import HostCopier, NativeCopyQueue, flat_int64
from kvcache_offload.dataplane.copy.plan import TransferPlan
from kvcache_offload.dataplane.handlers.copy_thread import QueuedCopy

__all__ = ["HostCopyQueue", "NativeCopy"]


def _not_run() -> None:  # pragma: no cover - a native copy is never run from Python
    raise RuntimeError("a native copy runs on its queue's thread")


class NativeCopy(QueuedCopy):
    """A copy on the native queue, marked done when the queue reports it."""

    __slots__ = ("seq",)

    def __init__(self, seq: int) -> None:
        super().__init__(_not_run, ())
        self.seq = seq


class HostCopyQueue:
    """Copies whole plans of one :class:`HostCopier` in order on a GIL-free thread."""

    def __init__(
        self, copier: HostCopier, name: str = "kvoffload-copy", batch_policy: bool = True
    ) -> None:
        """``batch_policy``: the copy thread runs under ``SCHED_BATCH`` (Linux), so waking it
        never preempts the submitting loop thread on a shared core."""
        if NativeCopyQueue is None:
            raise RuntimeError("the host-copy extension is not built")
        self._copier = copier
        self._native = NativeCopyQueue(name, batch_policy=batch_policy)
        # A handler's plans pass the same ref arrays job after job: id(ref_tensors) ->
        # (the array, kept so its id stays unique, group id), bounded like SideGeometry's
        # cache. Behind it the native groups are keyed by content, so fresh arrays of the
        # same refs never add a group.
        self._groups: dict[int, tuple[np.ndarray, int]] = {}
        self._group_of_refs: dict[tuple[bytes, bytes], int] = {}
        self._run_now = getattr(self._native, "run_now", None)
        self.in_flight: dict[int, NativeCopy] = {}
        """The copies queued and not yet collected, by sequence number (empty: nothing for
        :meth:`collect` to find, so a handler skips the call)."""

    @staticmethod
    def available() -> bool:
        return NativeCopyQueue is not None

    def _group_id(self, ref_tensors: np.ndarray, ref_sizes: np.ndarray) -> int:
        known = self._groups.get(id(ref_tensors))
        if known is not None and known[0] is ref_tensors:
            return known[1]
        content = (np.asarray(ref_tensors).tobytes(), np.asarray(ref_sizes).tobytes())
        gid = self._group_of_refs.get(content)
        if gid is None:
            columns = self._copier.ref_columns(ref_tensors, ref_sizes)
            gid = int(self._native.add_group(*columns, self._copier.streaming))
            self._group_of_refs[content] = gid
        if len(self._groups) < 64:
            self._groups[id(ref_tensors)] = (ref_tensors, gid)
        return gid

    def submit(self, plan: TransferPlan) -> NativeCopy:
        """Queue ``plan``'s copy; raises RuntimeError once closed."""
        parts = [
            (
                self._group_id(g.ref_tensors, g.ref_sizes),
                flat_int64(g.src_units),
                flat_int64(g.dst_units),
            )
            for g in plan.groups
            if len(g.ref_tensors) and len(g.src_units)
        ]
        copy = NativeCopy(int(self._native.submit(parts)))
        self.in_flight[copy.seq] = copy
        return copy

    def submit_units(
        self,
        ref_tensors: np.ndarray,
        ref_sizes: np.ndarray,
        jobs: list[tuple[np.ndarray, int]],
    ) -> NativeCopy:
        """Queue jobs of one group given as their checked units (``2 * size`` int64 each:
        source units, then destination units) as one copy: a batch of held one-group jobs
        without a plan built or merged for it. One part, the jobs' units in order (the
        thread walks a part layer by layer, so a batch of adjacent blocks reads each
        layer's blocks in one sweep: one part per job ran 4-block streams 6-7 % slower).
        Raises RuntimeError once closed."""
        gid = self._group_id(ref_tensors, ref_sizes)
        if len(jobs) == 1:
            units, size = jobs[0]
            part = (gid, units[:size], units[size:])
        else:
            part = (
                gid,
                np.concatenate([units[:size] for units, size in jobs]),
                np.concatenate([units[size:] for units, size in jobs]),
            )
        copy = NativeCopy(int(self._native.submit([part])))
        self.in_flight[copy.seq] = copy
        return copy

    @property
    def runs_now(self) -> bool:
        """Whether :meth:`run_now` copies through the registered groups (an extension built
        before it existed has no ``CopyQueue.run_now``)."""
        return self._run_now is not None

    def run_now(self, plan: TransferPlan) -> None:
        """Copy ``plan`` on the calling thread, now (GIL released during each part), with
        the columns of the groups registered once: what ``HostCopier.run`` does for a job
        copied inline, minus parsing every column per call. The caller keeps the order (the
        queue is idle). Needs :attr:`runs_now`."""
        run = self._run_now
        assert run is not None
        for g in plan.groups:
            if len(g.ref_tensors) and len(g.src_units):
                run(
                    self._group_id(g.ref_tensors, g.ref_sizes),
                    flat_int64(g.src_units),
                    flat_int64(g.dst_units),
                )

    def collect(self) -> None:
        """Mark every copy the thread finished (or cancelled at close) as done."""
        for seq, seconds, cancelled in self._native.take_finished():
            copy = self.in_flight.pop(seq, None)
            if copy is not None:
                copy.finish(seconds, cancelled)

    def wait(self, copies: list[QueuedCopy]) -> None:
        """Block (GIL released) until every copy of this queue in ``copies`` ended; they are
        marked done by the next :meth:`collect`."""
        seqs = [c.seq for c in copies if isinstance(c, NativeCopy)]
        if seqs:
            self._native.wait(max(seqs))

    def fileno(self) -> int:
        """Readable after a copy ended (an eventfd; read it to clear)."""
        return int(self._native.fileno())

    def close(self) -> None:
        """Cancel the copies not started, let the running one end, stop the thread."""
        self._native.close()
        self.collect()
