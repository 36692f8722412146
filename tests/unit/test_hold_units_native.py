"""Holding a job for a batch in one C call (the CUDA handlers' ``_hold_units``): the units it
writes are the planner's, the destination blocks it marks are the ones the job writes, a job
writing a block a held job writes is refused with nothing marked, and a malformed job is left
to the Python planner. :class:`MarkedHeldJobs` keeps the marks for the jobs held otherwise."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache_offload.dataplane.handlers.held_jobs import MarkedHeldJobs

hostcopy = pytest.importorskip(
    "kvcache_offload.dataplane.copy._hostcopy", reason="the host-copy extension is not built"
)

SRC_ROWS, DST_ROWS = 30, 20
HELD, CONFLICT, MALFORMED, NO_ROOM = 1, 0, -1, -2


class _Job:
    def __init__(self, num_bytes: int) -> None:
        self.num_bytes = num_bytes


def _ids(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _hold(src, dst, size, start, factor, src_units, dst_units, used, held):
    marks, mark = held.current_marks()
    return hostcopy.hold_units(
        src, dst, size, start, 1, factor, SRC_ROWS, DST_ROWS,
        src_units, dst_units, used, marks, mark,
    )  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    factor=st.sampled_from([1, 2, 3]),
    jobs=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 2**16)), min_size=1, max_size=6),
)
def test_held_jobs_units_are_the_planners_back_to_back_and_their_blocks_marked(factor, jobs):
    held: MarkedHeldJobs[_Job] = MarkedHeldJobs(DST_ROWS)
    src_units = np.full(64, -7, dtype=np.int64)
    dst_units = np.full(64, -7, dtype=np.int64)
    used, want_src, want_dst, written = 0, [], [], set()
    for size, seed in jobs:
        rng = np.random.default_rng(seed)
        start = int(rng.integers(0, factor))
        dst_n = -(-(size + start % factor) // factor)
        src = rng.integers(0, SRC_ROWS, size).astype(np.int64)
        dst = rng.choice(DST_ROWS, dst_n, replace=False).astype(np.int64)
        planned = np.empty(2 * size, dtype=np.int64)
        assert hostcopy.plan_units(src, dst, size, start, 1, factor, SRC_ROWS, DST_ROWS, planned)
        outcome = _hold(src, dst, size, start, factor, src_units, dst_units, used, held)
        blocks = set(dst.tolist())
        if blocks & written:
            assert outcome == CONFLICT
        else:
            assert outcome == HELD
            held.add_marked(len(held.jobs), _Job(size))
            want_src += planned[:size].tolist()
            want_dst += planned[size:].tolist()
            written |= blocks
            used += size
        assert src_units[:used].tolist() == want_src
        assert dst_units[:used].tolist() == want_dst
        assert set(np.flatnonzero(held.marks == held.mark).tolist()) == written
    assert held.writes_any(written) or not written
    assert not held.writes_any(set(range(DST_ROWS)) - written)
    for block in written:  # the few-block check, one block at a time
        assert held.writes_any({block})


def test_a_conflicting_job_marks_nothing_and_a_new_batch_forgets_the_marks():
    held: MarkedHeldJobs[_Job] = MarkedHeldJobs(DST_ROWS)
    units = np.zeros(8, dtype=np.int64), np.zeros(8, dtype=np.int64)
    assert _hold(_ids([1, 2]), _ids([5, 6]), 2, 0, 1, *units, 0, held) == HELD
    held.add_marked(1, _Job(2))
    # Writes 7 (free) and 6 (held): refused, and 7 stays unmarked.
    assert _hold(_ids([3, 4]), _ids([7, 6]), 2, 0, 1, *units, 2, held) == CONFLICT
    assert not held.writes_any({7})
    assert held.writes_any({6})
    assert [job_id for job_id, _ in held.take()] == [1]
    # The next batch: the same blocks are free again.
    assert not held.writes_any({5, 6})
    assert _hold(_ids([3, 4]), _ids([7, 6]), 2, 0, 1, *units, 0, held) == HELD


@pytest.mark.parametrize(
    ("src", "dst", "size", "start", "why"),
    [
        ([1, 2], [5, 6], 0, 0, "no pieces"),
        ([1, 2], [5, 6], 2, -1, "negative start"),
        ([1, 2], [5], 2, 0, "too few destination ids"),
        ([1, 2, 3], [5, 6], 2, 0, "too many source ids"),
        ([1, SRC_ROWS], [5, 6], 2, 0, "a source id out of range"),
        ([1, 2], [-1, 6], 2, 0, "a negative destination id"),
        ([1, 2], [5, DST_ROWS], 2, 0, "a destination id out of range"),
    ],
)
def test_a_malformed_job_is_left_to_the_python_planner_with_nothing_marked(
    src, dst, size, start, why
):
    held: MarkedHeldJobs[_Job] = MarkedHeldJobs(DST_ROWS)
    units = np.zeros(8, dtype=np.int64), np.zeros(8, dtype=np.int64)
    assert _hold(_ids(src), _ids(dst), size, start, 1, *units, 0, held) == MALFORMED, why
    assert not (held.marks == held.mark).any()


def test_no_room_writes_nothing_and_short_marks_are_refused():
    held: MarkedHeldJobs[_Job] = MarkedHeldJobs(DST_ROWS)
    src_units, dst_units = np.zeros(3, dtype=np.int64), np.zeros(3, dtype=np.int64)
    assert _hold(_ids([1, 2]), _ids([5, 6]), 2, 0, 1, src_units, dst_units, 2, held) == NO_ROOM
    assert src_units.tolist() == dst_units.tolist() == [0, 0, 0]
    assert not (held.marks == held.mark).any()
    with pytest.raises(ValueError, match="marks has 4 entries"):
        hostcopy.hold_units(
            _ids([1]), _ids([5]), 1, 0, 1, 1, SRC_ROWS, DST_ROWS,
            src_units, dst_units, 0, np.zeros(4, dtype=np.int64), 1,
        )  # fmt: skip
    # A strided id view: the handler then takes the general path.
    with pytest.raises((BufferError, ValueError), match="contiguous"):
        _hold(np.arange(8, dtype=np.int64)[::4], _ids([5, 6]), 2, 0, 1, *(
            np.zeros(8, dtype=np.int64), np.zeros(8, dtype=np.int64)), 0, held)  # fmt: skip


def test_jobs_held_by_plan_mark_their_blocks_for_the_c_check():
    # A job held as a plan (its blocks given as a set) blocks a later C hold of one of them,
    # and a job held in C blocks a later plan job writing one of its blocks.
    held: MarkedHeldJobs[_Job] = MarkedHeldJobs(DST_ROWS)
    held.add(1, _Job(4), {3, 4})
    assert held.nbytes == 4 and 1 in held
    assert held.writes_any({4}) and not held.writes_any({5})
    units = np.zeros(8, dtype=np.int64), np.zeros(8, dtype=np.int64)
    assert _hold(_ids([0]), _ids([4]), 1, 0, 1, *units, 0, held) == CONFLICT
    assert _hold(_ids([0]), _ids([5]), 1, 0, 1, *units, 0, held) == HELD
    held.add_marked(2, _Job(1))
    assert held.writes_any({5}) and held.writes_any(set(range(9, DST_ROWS)) | {5})
    assert not held.writes_any({6}) and not held.writes_any(set(range(6, DST_ROWS)))
    held.add(3, _Job(1), {7})  # after a C hold: its set is checked, and marked when asked
    assert held.writes_any({7})
    assert _hold(_ids([0]), _ids([7]), 1, 0, 1, *units, 0, held) == CONFLICT
    held.take()
    assert not held.writes_any({3, 4, 5, 7})
