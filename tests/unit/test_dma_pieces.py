"""Coalescing a DMA job's pieces: adjacent pieces become one copy, the bytes stay the same."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache_offload.dataplane.copy import dma
from kvcache_offload.dataplane.copy.dma import FEW_PIECES, CudaRuntime, coalesce_pieces


def _byte_pairs(table: np.ndarray) -> set[tuple[int, int]]:
    """Every (source byte, destination byte) address pair the table copies."""
    pairs = set()
    for src, dst, size in zip(*table.tolist(), strict=True):
        pairs.update((src + i, dst + i) for i in range(size))
    return pairs


def test_consecutive_blocks_into_consecutive_slots_are_one_copy():
    size = 2 << 20
    src = 1 << 40
    dst = 1 << 30
    table = np.array(
        [[src + i * size for i in range(8)], [dst + i * size for i in range(8)], [size] * 8],
        dtype=np.int64,
    )
    merged = coalesce_pieces(table)
    assert merged.tolist() == [[src], [dst], [8 * size]]


def test_pieces_adjacent_on_one_side_only_stay_apart():
    # Per-layer fragments: adjacent on the GPU side, a block apart on the CPU side.
    table = np.array([[0, 64, 128], [0, 4096, 8192], [64, 64, 64]], dtype=np.int64)
    assert coalesce_pieces(table).tolist() == table.tolist()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(1, 4)), min_size=0, max_size=12
    )
)
def test_coalescing_copies_exactly_the_same_bytes_in_fewer_or_equal_pieces(steps):
    # Walk both sides, each piece starting right after the last one or after a gap.
    src, dst, rows = 1000, 5000, []
    for src_gap, dst_gap, size in steps:
        src += src_gap
        dst += dst_gap
        rows.append((src, dst, size))
        src += size
        dst += size
    table = np.array(rows, dtype=np.int64).reshape(-1, 3).T.copy()
    merged = coalesce_pieces(table)
    assert merged.shape[1] <= table.shape[1]
    assert _byte_pairs(merged) == _byte_pairs(table)
    # No two remaining neighbours could have been merged.
    for a, b in zip(merged.T.tolist(), merged.T.tolist()[1:], strict=False):
        assert not (a[0] + a[2] == b[0] and a[1] + a[2] == b[1])


class _RecordingRuntime(CudaRuntime):
    """A CudaRuntime whose ``cudaMemcpyAsync`` is a Python function recording each call (through
    the same ctypes prototype, so the extension's ``issue_copies`` calls it too) and whose
    batched call records its arrays; no CUDA here. The call numbered ``fail_at`` (from 0)
    returns error 1."""

    def __init__(self, fail_at: int | None = None) -> None:  # nothing of CUDA to load
        self.calls: list[tuple[str, object]] = []

        def memcpy(dst: int, src: int, nbytes: int, kind: int, stream: int) -> int:
            self.calls.append(("one", (dst, src, nbytes, stream)))
            return 1 if len(self.calls) - 1 == fail_at else 0

        self._memcpy = dma._MEMCPY_ASYNC(memcpy)
        self._memcpy_addr = ctypes.cast(self._memcpy, ctypes.c_void_p).value or 0

    def memcpy_batch_async(self, dsts, srcs, sizes, stream) -> None:  # type: ignore[no-untyped-def]
        self.calls.append(("batch", (dsts.tolist(), srcs.tolist(), sizes.tolist(), stream)))

    def error_string(self, code: int) -> str:
        return f"error {code}"


@pytest.fixture(params=["extension", "ctypes"])
def few_copies_by(request, monkeypatch):
    """Which loop makes the single copies: the host-copy extension's or the ctypes one."""
    if request.param == "extension" and dma._issue_copies is None:
        pytest.skip("the host-copy extension is not built")
    if request.param == "ctypes":
        monkeypatch.setattr(dma, "_issue_copies", None)
    return request.param


def _pieces(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    dsts = 1000 + np.arange(n, dtype=np.int64) * 100
    return dsts, dsts + 7, np.full(n, 3, dtype=np.int64)


def test_a_few_pieces_are_single_copies_and_more_are_one_batch(few_copies_by):
    for n in (1, FEW_PIECES, FEW_PIECES + 1):
        rt = _RecordingRuntime()
        dsts, srcs, sizes = _pieces(n)
        rt.memcpy_pieces(dsts, srcs, sizes, 42)
        if n <= FEW_PIECES:
            assert rt.calls == [("one", (d, d + 7, 3, 42)) for d in dsts.tolist()]
        else:
            assert rt.calls == [("batch", (dsts.tolist(), srcs.tolist(), sizes.tolist(), 42))]


def test_a_failed_single_copy_raises_and_issues_nothing_after_it(few_copies_by):
    rt = _RecordingRuntime(fail_at=1)
    dsts, srcs, sizes = _pieces(FEW_PIECES)
    sizes[1] = 5
    with pytest.raises(RuntimeError, match=r"cudaMemcpyAsync of 5 bytes failed: error 1"):
        rt.memcpy_pieces(dsts, srcs, sizes, 42)
    assert len(rt.calls) == 2


def test_issue_copies_refuses_buffers_of_different_lengths():
    if dma._issue_copies is None:
        pytest.skip("the host-copy extension is not built")
    rt = _RecordingRuntime()
    dsts, srcs, sizes = _pieces(3)
    with pytest.raises(ValueError, match="one length"):
        dma._issue_copies(rt._memcpy_addr, dsts, srcs[:2], sizes, 4, 42)
    with pytest.raises(ValueError, match="a function"):
        dma._issue_copies(0, dsts, srcs, sizes, 4, 42)
    assert rt.calls == []
