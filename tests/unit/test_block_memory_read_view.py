"""``read_view`` gives a block's bytes as a read-only copy that later writes do not change."""

from __future__ import annotations

import numpy as np
import pytest

from kvcache_offload.dataplane.memory.block_memory import (
    BlockMemory,
    HostBlockMemory,
    TensorBlockMemory,
)


def memories() -> list[BlockMemory]:
    pages = [np.zeros((4, n), np.uint8) for n in (16, 48)]
    return [HostBlockMemory(4, 64), TensorBlockMemory(pages)]


@pytest.mark.parametrize("memory", memories(), ids=["host", "tensors"])
def test_read_view_is_a_read_only_copy_of_the_block(memory: BlockMemory) -> None:
    block = bytes(range(64))
    memory.write(2, block)
    view = memory.read_view(2)
    assert view.readonly
    assert bytes(view) == block == memory.read(2)
    memory.write(2, bytes(64))
    assert bytes(view) == block
