"""vLLM's job specs and canonical KV caches -> this library's, at the handler boundary.

vLLM hands the worker its own ``GPULoadStoreSpec`` (block ids, ``group_sizes``,
``block_indices``) and whatever spec our manager returned for the CPU side; our handlers take
our spec classes only. The fields are the same in every supported vLLM release, so reading them
by name keeps this module free of vLLM imports.
"""

from __future__ import annotations

from typing import Any

from kvcache_offload.contracts.kv_caches import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
)
from kvcache_offload.contracts.load_store_spec import (
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    LoadStoreSpec,
)
from kvcache_offload.errors import TransferError

__all__ = ["canonical_kv_caches", "cpu_spec", "gpu_spec"]


def gpu_spec(spec: Any) -> GPULoadStoreSpec:
    """Our GPU spec for vLLM's (same block ids, group sizes and first-block indices)."""
    if isinstance(spec, GPULoadStoreSpec):
        return spec
    try:
        return GPULoadStoreSpec(spec.block_ids, spec.group_sizes, spec.block_indices)
    except AttributeError:
        raise TransferError(
            f"expected vLLM's GPULoadStoreSpec on the GPU side, got {type(spec).__name__}"
        ) from None


def cpu_spec(spec: Any) -> LoadStoreSpec:
    """Our CPU spec for the CPU-side spec of a job (ours already, or vLLM's CPULoadStoreSpec)."""
    if isinstance(spec, CPULoadStoreSpec):
        return spec
    block_ids = getattr(spec, "block_ids", None)
    if block_ids is None or hasattr(spec, "group_sizes"):
        raise TransferError(f"expected a CPU block-id spec, got {type(spec).__name__}")
    return CPULoadStoreSpec(block_ids)


def canonical_kv_caches(kv_caches: Any) -> CanonicalKVCaches:
    """Our canonical KV caches for vLLM's (same tensors, same per-group layer refs).

    vLLM 0.33 also gives each ref a mapping to its parallelism-free host page; it only matters
    with vLLM's ``canonical_layout``, which the spec refuses, so it is not carried over.
    """
    refs = [list(group) for group in kv_caches.group_data_refs]
    return CanonicalKVCaches(
        tensors=[
            CanonicalKVCacheTensor(t.tensor, int(t.page_size_bytes)) for t in kv_caches.tensors
        ],
        group_data_refs=[
            [CanonicalKVCacheRef(int(r.tensor_idx), int(r.page_size_bytes)) for r in group]
            for group in refs
        ],
    )
