"""One Triton kernel launch per job: GPU threads copy every fragment through UVA.

Pinned host memory (``cudaHostAlloc``, or ``cudaHostRegister`` with the mapped flag) is
addressable from the GPU at its host address on 64-bit Linux (unified virtual addressing),
so a kernel can read and write it directly: a store is device loads plus posted PCIe writes,
a load is PCIe reads plus device stores. One launch covers the whole job; the grid is
``(fragments, chunks per fragment)`` and each program copies ``BLOCK`` bytes (``iters``
times when a fragment needs more than 65,535 chunks).

The job's pointer table (int64: ``src[n] | dst[n] | size[n]``; sizes omitted when uniform)
is uploaded once per job by the caller; the kernel reads it with three scalar loads per
program. Addresses, sizes and the chunk start carry divisibility hints so Triton emits
16-byte vector accesses when everything is 16-byte aligned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["KernelConfig", "launch_copy_kernel", "triton_available"]

try:  # Triton is optional: without it the handlers use batched DMA or the torch fallback.
    import triton
    import triton.language as tl

    _TRITON_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the platform
    triton = None
    tl = None
    _TRITON_ERROR = f"{type(exc).__name__}: {exc}"

_MAX_GRID_Y = 65_535


@dataclass(frozen=True)
class KernelConfig:
    block_bytes: int = 8192
    """Bytes per program per iteration (a power of two)."""
    num_warps: int = 4


DEFAULT_KERNEL_CONFIG = KernelConfig()


def triton_available() -> tuple[bool, str | None]:
    """(usable, reason when not)."""
    if triton is None:
        return False, f"triton is not importable ({_TRITON_ERROR})"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    return True, None


if triton is not None:

    @triton.jit(do_not_specialize=["n_frags", "size_arg", "iters"])
    def _uva_copy_kernel(  # type: ignore[no-untyped-def]
        table_ptr,
        n_frags,
        size_arg,
        iters,
        BLOCK: tl.constexpr,
        UNIFORM: tl.constexpr,
        ALIGN: tl.constexpr,
    ):
        frag = tl.program_id(0).to(tl.int64)
        chunk0 = tl.program_id(1).to(tl.int64) * iters
        src_addr = tl.load(table_ptr + frag)
        dst_addr = tl.load(table_ptr + n_frags + frag)
        if UNIFORM:  # noqa: SIM108 (constexpr branch)
            size = size_arg.to(tl.int64)
        else:
            size = tl.load(table_ptr + 2 * n_frags + frag)
        src_addr = tl.multiple_of(src_addr, ALIGN)
        dst_addr = tl.multiple_of(dst_addr, ALIGN)
        size = tl.multiple_of(size, ALIGN)
        src = tl.multiple_of(src_addr.to(tl.pointer_type(tl.uint8)), ALIGN)
        dst = tl.multiple_of(dst_addr.to(tl.pointer_type(tl.uint8)), ALIGN)
        offs = tl.arange(0, BLOCK)
        for i in range(iters):
            start = (chunk0 + i) * BLOCK
            o = start + offs
            mask = o < size
            data = tl.load(src + o, mask=mask, cache_modifier=".cg")
            tl.store(dst + o, data, mask=mask, cache_modifier=".cs")


def launch_copy_kernel(
    table: torch.Tensor,
    n_frags: int,
    uniform_size: int | None,
    max_size: int,
    alignment: int,
    config: KernelConfig = DEFAULT_KERNEL_CONFIG,
) -> Any:
    """Launch on the current CUDA stream; ``table`` is the device int64 pointer table."""
    if triton is None:  # pragma: no cover
        raise RuntimeError(f"triton is not available: {_TRITON_ERROR}")
    if n_frags <= 0:
        return None
    block = config.block_bytes
    chunks = -(-max_size // block)
    iters = max(1, -(-chunks // _MAX_GRID_Y))
    grid = (n_frags, -(-chunks // iters))
    return _uva_copy_kernel[grid](
        table,
        n_frags,
        uniform_size if uniform_size is not None else 0,
        iters,
        BLOCK=block,
        UNIFORM=uniform_size is not None,
        ALIGN=alignment,
        num_warps=config.num_warps,
    )
