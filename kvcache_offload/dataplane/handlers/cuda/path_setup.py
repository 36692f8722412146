"""Setting up a CUDA handler's copy paths once its probe chose them (``paths.py``): the
kernel's address table, the staged path's copier, the torch fallback, the lone-kernel lane."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvcache_offload.contracts.kv_caches import CanonicalKVCacheRef
from kvcache_offload.dataplane.copy.plan import CopySides
from kvcache_offload.dataplane.copy.staging_config import StagingConfig
from kvcache_offload.dataplane.handlers.cuda.path_choice import lone_kernel_limit
from kvcache_offload.dataplane.handlers.cuda.paths import build_ref_table, make_torch_fallback

if TYPE_CHECKING:
    from kvcache_offload.dataplane.handlers.cuda.handler import SingleDirectionOffloadingHandler

__all__ = ["start_paths"]


def start_paths(
    h: SingleDirectionOffloadingHandler,
    gpu_tensors: Sequence[torch.Tensor],
    cpu_tensors: Sequence[torch.Tensor],
    factor: int,
    staging: StagingConfig,
    sides: CopySides,
    kv_cache_groups_data_refs: Sequence[Sequence[CanonicalKVCacheRef]],
    max_staging_bytes: int,
) -> None:
    """Set up the paths ``h`` may take: the kernel's address table, the staged path's
    copier, the torch fallback and the lone-kernel lane."""
    if h.kernel_ok and h.mechanism in ("auto", "kernel"):
        h._launcher.set_ref_table(*build_ref_table(h._group_refs, h.src_geom, h.dst_geom, h.device))
    wants_staged = h.mechanism == "staged" or (
        h.mechanism == "auto"
        and h.staged_ok
        and staging.auto_min_piece_bytes is not None
        and all(t.numel() == 0 or t.is_pinned() for t in cpu_tensors)
    )
    h._staged = (
        h._launcher.start_staged(gpu_tensors, cpu_tensors, factor, h._group_refs, staging)
        if wants_staged
        else None
    )
    if h.mechanism == "torch":
        h._fallback = make_torch_fallback(
            sides,
            kv_cache_groups_data_refs,
            gpu_to_cpu=h.gpu_to_cpu,
            device=h.device,
            max_staging_bytes=max_staging_bytes,
        )
    h._lone_limit = lone_kernel_limit(h)
    single = h._planner.single_group
    if h._lone_limit and single is not None:
        h._launcher.plan_lone_units(
            src_rows=h.src_geom.num_rows,
            dst_rows=h.dst_geom.num_rows,
            pairs_per_unit=len(single.tensors),
            max_size=single.max_size,
        )
