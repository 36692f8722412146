"""Coalescing a DMA job's pieces: adjacent pieces become one copy, the bytes stay the same."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache_offload.dataplane.copy.dma import coalesce_pieces


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


class _RecordingRuntime:
    """Stands in for CudaRuntime's two enqueue calls (no CUDA here)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.calls.append(("one", (dst, src, nbytes, stream)))

    def memcpy_batch_async(self, dsts, srcs, sizes, stream) -> None:  # type: ignore[no-untyped-def]
        self.calls.append(("batch", (dsts.tolist(), srcs.tolist(), sizes.tolist(), stream)))


def test_a_few_pieces_are_single_copies_and_more_are_one_batch():
    from kvcache_offload.dataplane.copy.dma import FEW_PIECES, CudaRuntime

    for n in (1, FEW_PIECES, FEW_PIECES + 1):
        rt = _RecordingRuntime()
        dsts = np.arange(n, dtype=np.int64) * 100
        srcs = dsts + 7
        sizes = np.full(n, 3, dtype=np.int64)
        CudaRuntime.memcpy_pieces(rt, dsts, srcs, sizes, 42)  # type: ignore[arg-type]
        if n <= FEW_PIECES:
            assert rt.calls == [("one", (d, d + 7, 3, 42)) for d in dsts.tolist()]
        else:
            assert rt.calls == [("batch", (dsts.tolist(), srcs.tolist(), sizes.tolist(), 42))]
