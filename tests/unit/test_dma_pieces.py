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
