"""Turn the GPU block ids a caller passes to ``store``/``load`` into a :class:`GPULoadStoreSpec`.

Callers of the engine pass either a ready :class:`GPULoadStoreSpec` or a flat list of GPU
block ids: ``block_size_factor`` ids per key, keys (and so ids) ordered group by group. A
store usually writes only some of its keys (the others are already offloaded), so the ids of
the keys actually stored are picked out and the group sizes recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvcache_offload.contracts.load_store_spec import GPULoadStoreSpec, int64_block_ids
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import ConfigError

__all__ = ["gpu_spec_for_keys"]


def _group_sizes(keys: Sequence[OffloadKey], num_groups: int, factor: int) -> list[int]:
    if num_groups == 1:
        return [len(keys) * factor]
    counts = [0] * num_groups
    last = 0
    for key in keys:
        group = int.from_bytes(key[-4:], "big")
        if group >= num_groups:
            raise ConfigError(f"key {key.hex()} names KV-cache group {group}, only {num_groups}")
        if group < last:
            raise ConfigError("keys must be ordered group by group (ascending group index)")
        last = group
        counts[group] += factor
    return counts


def gpu_spec_for_keys(
    keys: Sequence[OffloadKey],
    gpu_blocks: Sequence[int] | np.ndarray | GPULoadStoreSpec,
    *,
    factor: int,
    num_groups: int,
    selected: Sequence[int] | None = None,
) -> GPULoadStoreSpec:
    """The GPU spec for ``keys`` (or for ``keys[i] for i in selected``).

    Without a selection a flat id list may be short by up to ``factor - 1`` ids for a single
    group: the first offloaded block is then only partly copied (its leading GPU blocks are
    already on the GPU), which is what a load after a partial GPU prefix-cache hit needs.
    """
    if type(gpu_blocks) is list and selected is None and num_groups == 1:
        # The common call (a flat list of ids, one KV-cache group, every key): the path
        # below without its checks of other cases.
        ids = int64_block_ids(gpu_blocks, "GPU block ids")
        if ids.ndim != 1:
            ids = ids.reshape(-1)
        elif len(ids) == len(keys) * factor:
            return GPULoadStoreSpec.checked_parts(ids, (len(ids),), (0,))
    # A plain list skips the ABC's isinstance machinery (~0.5 us).
    elif type(gpu_blocks) is not list and isinstance(gpu_blocks, GPULoadStoreSpec):
        if selected is None or len(selected) == len(keys):
            return gpu_blocks
        ids = gpu_blocks.block_ids
        if len(ids) != len(keys) * factor:
            raise ConfigError(
                f"a GPULoadStoreSpec with {len(ids)} ids for {len(keys)} keys (factor {factor}) "
                "cannot be narrowed to the keys that need storing; pass one id per GPU block"
            )
    else:
        ids = int64_block_ids(gpu_blocks, "GPU block ids")
        if ids.ndim != 1:  # a flat list is 1-D already: no reshape call per job
            ids = ids.reshape(-1)
    if selected is not None and len(selected) != len(keys):
        idx = np.asarray(selected, dtype=np.int64)
        per_key = ids.reshape(len(keys), factor) if len(ids) == len(keys) * factor else None
        if per_key is None:
            raise ConfigError(
                f"expected {len(keys) * factor} GPU block ids ({factor} per key), got {len(ids)}"
            )
        picked = [keys[i] for i in selected]
        return GPULoadStoreSpec(
            per_key[idx].reshape(-1), _group_sizes(picked, num_groups, factor), [0] * num_groups
        )
    total = len(keys) * factor
    skip = total - len(ids)
    if skip == 0:
        if num_groups == 1:  # the common model: what _group_sizes answers, without the call
            return GPULoadStoreSpec.checked_parts(ids, (total,), (0,))
        sizes = _group_sizes(keys, num_groups, factor)
        return GPULoadStoreSpec.checked_parts(ids, tuple(sizes), (0,) * num_groups)
    if num_groups == 1 and 0 < skip < factor:
        return GPULoadStoreSpec(ids, [len(ids)], [skip])
    raise ConfigError(
        f"expected {total} GPU block ids ({factor} per key for {len(keys)} keys), got {len(ids)}"
    )
