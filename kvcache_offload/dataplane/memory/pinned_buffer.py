"""Pinned host memory of exactly the size asked for, for the private CPU tier.

torch's pinned allocator (``pin_memory=True``) rounds every request up to the next power of
two, so a 40 GiB CPU tier would lock 64 GiB of RAM (the same defect other offloaders hit:
vLLM #56410, SGLang #36562). Here the buffer is anonymous memory of the exact size, pinned and
mapped for the GPU with ``cudaHostRegister``; the registration is dropped when the last tensor
viewing the buffer is gone (or at interpreter exit), before the memory is unmapped.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["pinned_zeros"]

logger = logging.getLogger(__name__)

USE_HUGE_PAGES = True
"""Ask for transparent huge pages on the buffer (a hint; the kernel may ignore it)."""


def _unregister(ptr: int, keep_alive: mmap.mmap) -> None:
    """Undo ``cudaHostRegister``; ``keep_alive`` holds the mapping until this has run."""
    from kvcache_offload.dataplane.copy.dma import get_cuda_runtime

    runtime = get_cuda_runtime()
    if runtime is None:
        return
    ok, msg = runtime.host_unregister(ptr)
    if not ok:
        logger.debug("cudaHostUnregister(%#x) failed: %s", ptr, msg)


def pinned_zeros(rows: int, cols: int) -> torch.Tensor:
    """A zeroed ``(rows, cols)`` int8 CPU tensor in page-locked, GPU-mapped memory.

    Exactly ``rows * cols`` bytes (rounded up to a page) are locked. Falls back to torch's
    pinned allocator, with a warning, when the CUDA runtime cannot register the memory.
    """
    import torch

    from kvcache_offload.dataplane.copy.dma import get_cuda_runtime

    nbytes = rows * cols
    runtime = get_cuda_runtime()
    if runtime is None or nbytes == 0:
        return torch.zeros((rows, cols), dtype=torch.int8, pin_memory=nbytes > 0)
    mapping = mmap.mmap(-1, nbytes)  # anonymous: zero-filled, page-aligned
    if USE_HUGE_PAGES and hasattr(mmap, "MADV_HUGEPAGE"):
        # Fewer, larger pages to lock and to translate for the copy engines.
        with contextlib.suppress(OSError):
            mapping.madvise(mmap.MADV_HUGEPAGE)
    flat = torch.frombuffer(mapping, dtype=torch.int8)
    ptr = flat.data_ptr()
    ok, msg = runtime.host_register(ptr, nbytes)
    if not ok:
        logger.warning(
            "cudaHostRegister of %d bytes failed (%s): using torch's pinned allocator, which "
            "rounds the CPU tier up to a power of two",
            nbytes,
            msg,
        )
        del flat
        mapping.close()
        return torch.zeros((rows, cols), dtype=torch.int8, pin_memory=True)
    # Views made from ``flat`` keep it alive through ``._base``; once the last one is gone
    # the registration is dropped, then the mapping is released.
    weakref.finalize(flat, _unregister, ptr, mapping)
    return flat.view(rows, cols)
