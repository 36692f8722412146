"""The UVA copy kernel itself (device code): GPU threads copy every fragment of a job.

Each work item is one ``BLOCK``-byte chunk of a (ref, unit) pair; its addresses come from
the ref table and the job's units, read from the job table or, for a one-group job of at
most :data:`INLINE_UNITS` units, from the kernel's parameters. ``triton_kernel.py`` says
why and launches it.
"""

from __future__ import annotations

try:  # Triton is optional: without it the handlers use batched DMA or the torch fallback.
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the platform
    triton = None
    tl = None

__all__ = ["INLINE_UNITS", "uva_copy_kernel"]

INLINE_UNITS = 8
"""Units per side a one-group job may pass as kernel parameters instead of a job table."""


if triton is not None:  # the kernel exists only where Triton does
    _UNIT_PARAMS = [f"{side}{i}" for side in "sd" for i in range(INLINE_UNITS)]
    _NO_SPEC = [
        "n_groups", "n_units", "total_work", "iters", "chunks", "src_factor", "dst_factor",
        "ref_row", *_UNIT_PARAMS,
    ]  # fmt: skip

    @triton.jit
    def _pick(i, v0, v1, v2, v3, v4, v5, v6, v7):  # type: ignore[no-untyped-def]
        """Parameter ``v{i}`` (i in 0..7) as int64: the kernel cannot index its parameters."""
        v = v0.to(tl.int64)
        v = tl.where(i == 1, v1, v)
        v = tl.where(i == 2, v2, v)
        v = tl.where(i == 3, v3, v)
        v = tl.where(i == 4, v4, v)
        v = tl.where(i == 5, v5, v)
        v = tl.where(i == 6, v6, v)
        v = tl.where(i == 7, v7, v)
        return v

    @triton.jit(do_not_specialize=_NO_SPEC)
    def uva_copy_kernel(  # type: ignore[no-untyped-def]
        ref_ptr,
        job_ptr,
        n_groups,
        n_units,
        total_work,
        iters,
        chunks,
        src_factor,
        dst_factor,
        ref_row,
        s0, s1, s2, s3, s4, s5, s6, s7,
        d0, d1, d2, d3, d4, d5, d6, d7,
        BLOCK: tl.constexpr,
        ALIGN: tl.constexpr,
    ):  # fmt: skip
        offs = tl.arange(0, BLOCK)
        units_ptr = job_ptr + 4 * n_groups
        pid = tl.program_id(0).to(tl.int64)
        nprog = tl.num_programs(0).to(tl.int64)
        for it in range(0, iters):
            w64 = pid + it * nprog
            if w64 < total_work:
                pair = w64 // chunks
                start = (w64 - pair * chunks) * BLOCK
                if n_groups == 0:  # one group, its units in the parameters
                    r = pair // n_units
                    i = pair - r * n_units
                    ref = ref_ptr + 8 * (ref_row + r)
                    su = _pick(i, s0, s1, s2, s3, s4, s5, s6, s7)
                    du = _pick(i, d0, d1, d2, d3, d4, d5, d6, d7)
                else:
                    g = pair * 0
                    for k in range(1, n_groups):
                        first = tl.load(job_ptr + 4 * k)
                        g = tl.where(pair >= first, k, g)
                    row = job_ptr + 4 * g
                    pair_start = tl.load(row)
                    n = tl.load(row + 1)
                    local = pair - pair_start
                    r = local // n
                    i = local - r * n
                    ref = ref_ptr + 8 * (tl.load(row + 2) + r)
                    unit = tl.load(row + 3) + i
                    su = tl.load(units_ptr + unit)
                    du = tl.load(units_ptr + n_units + unit)
                s_row = su // src_factor
                d_row = du // dst_factor
                src_addr = (
                    tl.load(ref)
                    + s_row * tl.load(ref + 1)
                    + (su - s_row * src_factor) * tl.load(ref + 2)
                )
                dst_addr = (
                    tl.load(ref + 3)
                    + d_row * tl.load(ref + 4)
                    + (du - d_row * dst_factor) * tl.load(ref + 5)
                )
                size = tl.multiple_of(tl.load(ref + 6), ALIGN)
                src_addr = tl.multiple_of(src_addr, ALIGN)
                dst_addr = tl.multiple_of(dst_addr, ALIGN)
                src = tl.multiple_of(src_addr.to(tl.pointer_type(tl.uint8)), ALIGN)
                dst = tl.multiple_of(dst_addr.to(tl.pointer_type(tl.uint8)), ALIGN)
                o = start + offs
                mask = o < size
                data = tl.load(src + o, mask=mask, cache_modifier=".cg")
                tl.store(dst + o, data, mask=mask, cache_modifier=".cs")
