"""The CPU backend: the GPU<->CPU handler contract where the "GPU" tensors are CPU tensors.

It runs the whole offloading flow on machines without a GPU (CI, the default service) and is
byte-exact with the CUDA path: the same canonical views, the same CPU layout (one CPU tensor
per canonical tensor, ``block_size_factor`` pages per slot), the same fragment plan, the same
un-padded page sizes.

Copies run on one worker thread per direction
(:class:`~kvcache_offload.dataplane.handlers.threaded.ThreadedOffloadingHandler`), so loads and
stores run concurrently; the copy itself is
:class:`~kvcache_offload.dataplane.copy.host_copy.HostCopier` (one GIL-free ``memcpy`` walk).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvcache_offload.contracts.kv_caches import (
    CanonicalKVCaches,
)
from kvcache_offload.dataplane.copy.host_copy import HostCopier
from kvcache_offload.dataplane.copy.plan import CopySides
from kvcache_offload.dataplane.handlers.handler_pair import HandlerPair
from kvcache_offload.dataplane.handlers.host_copy_queue import HostCopyQueue
from kvcache_offload.dataplane.handlers.threaded import (
    HOST_INLINE_MAX_BYTES,
    HOST_LONE_INLINE_MAX_BYTES,
    ThreadedOffloadingHandler,
)
from kvcache_offload.errors import ConfigError

if TYPE_CHECKING:
    from kvcache_offload.dataplane.memory.shared_offload_region import SharedOffloadRegion

__all__ = [
    "CpuBackendOffloadingHandlers",
    "allocate_cpu_tensors",
    "canonical_int8_views",
    "canonical_views_on",
]

logger = logging.getLogger(__name__)


def canonical_int8_views(kv_caches: CanonicalKVCaches) -> list[torch.Tensor]:
    """Each canonical tensor as a 2-D int8 ``(num_blocks, page_size_bytes)`` view.

    Tensors that are already 2-D int8 with ``page_size_bytes`` columns are used as they are
    (their rows may be strided, e.g. padded pages); others must be contiguous.
    """
    if not kv_caches.tensors:
        raise ConfigError("CanonicalKVCaches holds no tensors")
    views = []
    for i, entry in enumerate(kv_caches.tensors):
        t, page = entry.tensor, int(entry.page_size_bytes)
        if page <= 0:
            raise ConfigError(f"canonical tensor {i}: page_size_bytes must be > 0, got {page}")
        if t.dtype == torch.int8 and t.dim() == 2 and t.shape[1] == page and t.stride(1) == 1:
            views.append(t)
            continue
        if not t.is_contiguous():
            raise ConfigError(
                f"canonical tensor {i} of shape {tuple(t.shape)} and strides {t.stride()} is "
                f"neither a 2-D int8 (num_blocks, {page}) view nor contiguous"
            )
        flat = t.view(torch.int8).reshape(-1)
        if flat.numel() % page:
            raise ConfigError(
                f"canonical tensor {i} holds {flat.numel()} bytes, not a multiple of its page "
                f"size {page}"
            )
        views.append(flat.view(-1, page))
    for gi, refs in enumerate(kv_caches.group_data_refs):
        for ref in refs:
            if not 0 <= ref.tensor_idx < len(views):
                raise ConfigError(
                    f"group {gi} refers to canonical tensor {ref.tensor_idx}, but there are "
                    f"{len(views)}"
                )
            if not 0 < ref.page_size_bytes <= views[ref.tensor_idx].shape[1]:
                raise ConfigError(
                    f"group {gi}: un-padded page of {ref.page_size_bytes} bytes does not fit "
                    f"tensor {ref.tensor_idx}'s page of {views[ref.tensor_idx].shape[1]} bytes"
                )
    return views


def canonical_views_on(
    kv_caches: CanonicalKVCaches, device_type: str, why: str
) -> list[torch.Tensor]:
    """The canonical int8 views, checked to live on ``device_type`` (``why`` opens the error)."""
    views = canonical_int8_views(kv_caches)
    for i, t in enumerate(views):
        if t.device.type != device_type:
            raise ConfigError(f"{why}, canonical tensor {i} is on {t.device}")
    return views


def allocate_cpu_tensors(
    gpu_views: Sequence[torch.Tensor],
    block_size_factor: int,
    num_cpu_blocks: int,
    mmap_region: SharedOffloadRegion | None = None,
    pin_memory: bool = False,
) -> list[torch.Tensor]:
    """One ``(num_cpu_blocks, page * factor)`` int8 CPU tensor per canonical tensor.

    Views into the shared region when one is given (in canonical-tensor order: the region's
    cursor advances), else views of one zeroed ``(num_cpu_blocks, cell)`` buffer (pinned if
    asked). Either way the CPU side is *block-major*: slot ``b``'s pages of every tensor lie
    back to back in canonical order (``cell`` bytes from tensor 0's row ``b``), so one
    offloaded block is one contiguous piece of host memory (what the staged copy path
    moves with one DMA).
    """
    if block_size_factor < 1:
        raise ConfigError(f"block_size_factor must be >= 1, got {block_size_factor}")
    if num_cpu_blocks < 0:
        raise ConfigError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
    pages = [int(view.shape[1]) * block_size_factor for view in gpu_views]
    if mmap_region is not None:
        if mmap_region.num_blocks != num_cpu_blocks:
            raise ConfigError(
                f"the shared region holds {mmap_region.num_blocks} blocks, expected "
                f"num_cpu_blocks={num_cpu_blocks}"
            )
        return [mmap_region.create_next_view(page) for page in pages]
    cell = sum(pages)
    if pin_memory:
        # Exactly sized: torch's own pinned allocator rounds up to a power of two.
        from kvcache_offload.dataplane.memory.pinned_buffer import pinned_zeros

        buf = pinned_zeros(num_cpu_blocks, cell)
    else:
        buf = torch.zeros((num_cpu_blocks, cell), dtype=torch.int8)
    out = []
    offset = 0
    for page in pages:
        out.append(buf[:, offset : offset + page])
        offset += page
    return out


class CpuBackendOffloadingHandlers(HandlerPair[ThreadedOffloadingHandler]):
    """Store and load handlers over CPU "GPU" tensors; same constructor as the CUDA ones.

    ``kv_caches`` holds CPU tensors. ``cpu_tensors`` are the offloaded copies: one
    ``(num_cpu_blocks, page * block_size_factor)`` int8 tensor per canonical tensor, or views
    of ``mmap_region``.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        block_size_factor: int,
        num_cpu_blocks: int,
        mmap_region: SharedOffloadRegion | None = None,
        *,
        max_staging_bytes: int = 64 * 1024 * 1024,
        inline_max_bytes: int = HOST_INLINE_MAX_BYTES,
        lone_inline_max_bytes: int | None = None,
        native_queue: bool = True,
        stream_stores: bool = True,
    ) -> None:
        """``native_queue``: copy on the C extension's GIL-free thread where it is built (a
        Python copy thread otherwise, or with False). ``stream_stores``: stores write the
        CPU tier with non-temporal stores (x86-64 with the extension; see ``HostCopier``).
        ``inline_max_bytes``: a job this small that finds its direction's copy thread idle is
        copied on the submitting thread; ``lone_inline_max_bytes`` (default
        ``HOST_LONE_INLINE_MAX_BYTES``, or 0 when ``inline_max_bytes`` is 0: no inline copy
        at all): one this small, when both directions are idle."""
        if lone_inline_max_bytes is None:
            lone_inline_max_bytes = HOST_LONE_INLINE_MAX_BYTES if inline_max_bytes > 0 else 0
        self.gpu_tensors = canonical_views_on(kv_caches, "cpu", "the CPU backend needs CPU tensors")
        self.block_size_factor = int(block_size_factor)
        self.cpu_tensors = allocate_cpu_tensors(
            self.gpu_tensors, self.block_size_factor, num_cpu_blocks, mmap_region
        )
        del max_staging_bytes  # the host copy needs no staging; kept for callers that pass it
        self.native_queue = native_queue and HostCopyQueue.available()
        self.stream_stores = stream_stores
        self.host_copiers: dict[str, HostCopier] = {}
        """Each direction's copier ("store", "load"), for its settings."""
        self.gpu_to_cpu_handler, self.cpu_to_gpu_handler = (
            self._direction(kv_caches, gpu_to_cpu, inline_max_bytes, lone_inline_max_bytes)
            for gpu_to_cpu in (True, False)
        )
        self.gpu_to_cpu_handler.pair_with(self.cpu_to_gpu_handler)

    def shutdown(self) -> None:
        super().shutdown()
        for copier in self.host_copiers.values():
            copier.release()  # they keep the tier's tensors alive for their addresses

    def _direction(
        self,
        kv_caches: CanonicalKVCaches,
        gpu_to_cpu: bool,
        inline_max_bytes: int,
        lone_inline_max_bytes: int,
    ) -> ThreadedOffloadingHandler:
        sides = CopySides.of_direction(
            self.gpu_tensors, self.cpu_tensors, self.block_size_factor, gpu_to_cpu
        )
        copier = HostCopier(sides, streaming=gpu_to_cpu and self.stream_stores)
        self.host_copiers["store" if gpu_to_cpu else "load"] = copier
        name = "kvoffload-" + ("store" if gpu_to_cpu else "load")
        return ThreadedOffloadingHandler(
            sides=sides,
            group_data_refs=kv_caches.group_data_refs,
            gpu_to_cpu=gpu_to_cpu,
            run_plan=copier.run,
            thread_name=name,
            can_batch=True,
            inline_max_bytes=inline_max_bytes,
            lone_inline_max_bytes=lone_inline_max_bytes,
            copy_queue=HostCopyQueue(copier, name) if self.native_queue else None,
        )
