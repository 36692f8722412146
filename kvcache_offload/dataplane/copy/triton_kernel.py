"""One Triton kernel launch per job: GPU threads copy every fragment through UVA.

Pinned host memory (``cudaHostAlloc``, or ``cudaHostRegister`` with the mapped flag) is
addressable from the GPU at its host address on 64-bit Linux (unified virtual addressing),
so a kernel can read and write it directly: a store is device loads plus posted PCIe writes,
a load is PCIe reads plus device stores.

Tables (int64), so that the host does O(refs + blocks) work per job, not O(refs x blocks):

* the *ref table*, built once per handler and kept on the device: one row of 8 per
  (group, layer) ref: ``src_base, src_row_stride, src_sub, dst_base, dst_row_stride,
  dst_sub, size, 0``;
* the *job table*, uploaded once per job: ``n_groups`` rows of ``pair_start, units,
  ref_start, unit_start``, then every source unit, then every destination unit;
* or, for a one-group job of at most :data:`INLINE_UNITS` units, no job table at all:
  ``n_groups`` is 0 and the units travel as kernel parameters (``ref_row``, ``s0..s7``,
  ``d0..d7``), so the C issuer enqueues no upload before the kernel. On the H200 host that
  upload was one more driver call (about 4 us) and a small host-to-device copy the kernel
  waited for; reading the table from pinned host memory instead cost the kernel 8-11 us of
  PCIe reads (docs/transfers.md), parameters cost it nothing.

A *pair* is (ref, unit): one fragment; a *work item* is one ``BLOCK``-byte chunk of a pair.
The grid is persistent (``ctas_per_sm`` programs per SM, each looping over work items) so a
store kernel and a load kernel on two streams run side by side instead of one waiting for
the other's grid to drain; ``ctas_per_sm=0`` launches one program per work item instead.
Addresses and sizes carry divisibility hints so Triton emits 16-byte vector accesses when
the geometry is 16-byte aligned.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch

from kvcache_offload.dataplane.copy._uva_kernel import INLINE_UNITS

__all__ = [
    "DEFAULT_KERNEL_CONFIG",
    "INLINE_UNITS",
    "BoundCopyKernel",
    "KernelConfig",
    "launch_copy_kernel",
    "launch_hooks_installed",
    "on_device",
    "triton_available",
]

try:  # Triton is optional: without it the handlers use batched DMA or the torch fallback.
    import triton
    import triton.language as tl

    _TRITON_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the platform
    triton = None
    tl = None
    _TRITON_ERROR = f"{type(exc).__name__}: {exc}"

logger = logging.getLogger(__name__)

REF_ROW = 8
GROUP_ROW = 4
_TABLE_MODE = (0,) * (1 + 2 * INLINE_UNITS)
"""The inline parameters (``ref_row``, ``s0..s7``, ``d0..d7``) of a launch over a job table."""


@dataclass(frozen=True)
class KernelConfig:
    block_bytes: int = 16384
    """Bytes per work item (a power of two)."""
    num_warps: int = 4
    ctas_per_sm: int = 2
    """Persistent programs per SM; 0 = one program per work item."""


DEFAULT_KERNEL_CONFIG = KernelConfig()


def triton_available() -> tuple[bool, str | None]:
    """(usable, reason when not)."""
    if triton is None:
        return False, f"triton is not importable ({_TRITON_ERROR})"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    return True, None


if triton is not None:
    from kvcache_offload.dataplane.copy._uva_kernel import uva_copy_kernel as _uva_copy_kernel


_NUM_SMS: dict[int, int] = {}
_SAME_DEVICE = contextlib.nullcontext()


def on_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``torch.cuda.device(device)``, or nothing when it is current already: entering and
    leaving the guard costs several microseconds per copy, on a path that runs per job."""
    if device.index is None or device.index == torch.cuda.current_device():
        return _SAME_DEVICE
    return torch.cuda.device(device)


def _num_sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


_TESTED_TRITON = ((3, 4), (3, 6))
"""Triton releases whose launcher calling convention the direct launch below was checked
against; others always go through the JIT's dispatch."""


def _direct_launch_supported() -> bool:
    if triton is None or not hasattr(triton, "knobs"):
        return False
    try:
        major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    except ValueError:
        return False
    return _TESTED_TRITON[0] <= (major, minor) <= _TESTED_TRITON[1]


_DIRECT = _direct_launch_supported()
_COMPILED: dict[tuple[int, int, int, int], Any] = {}
"""Compiled kernel per (device, BLOCK, ALIGN, num_warps), taken from the first JIT launch.

Every int argument is unspecialised, so one compiled kernel serves every job of a handler.
Launching it directly skips the JIT's per-call argument binding and cache lookup, and the
tables go in as raw device addresses, which skips the launcher's per-pointer driver query;
on a 1-block job that dispatch cost as much host time as the rest of the submission."""


def _installed(hook: Any) -> Any:
    """``hook``, or None when it is an empty hook chain (Triton 3.5+ always sets one, so
    the launcher would call into Python twice per launch to run nothing)."""
    calls = getattr(hook, "calls", None)
    return None if isinstance(calls, list) and not calls else hook


def launch_hooks_installed() -> bool:
    """Whether Triton launch hooks are installed (a profiler that wants to see each launch:
    copies are then launched through Triton, which calls them)."""
    if triton is None or not hasattr(triton, "knobs"):
        return False
    hooks = triton.knobs.runtime
    return (
        _installed(hooks.launch_enter_hook) is not None
        or _installed(hooks.launch_exit_hook) is not None
    )


def _launch_direct(
    key: tuple[int, int, int, int],
    programs: int,
    stream: int,
    ref_ptr: int,
    job_ptr: int,
    scalars: tuple[int, ...],
    block: int,
    alignment: int,
) -> bool:
    """Launch the kernel compiled for ``key`` through Triton's launcher, skipping the JIT's
    argument binding and cache lookup; False when it is not compiled yet or the launcher's
    signature is not one we know (the direct launch is then off for the process)."""
    global _DIRECT
    compiled = _COMPILED.get(key) if _DIRECT else None
    if compiled is None:
        return False
    hooks = triton.knobs.runtime
    try:
        compiled.run(
            programs, 1, 1, stream, compiled.function, compiled.packed_metadata, None,
            _installed(hooks.launch_enter_hook), _installed(hooks.launch_exit_hook),
            ref_ptr, job_ptr, *scalars, *_TABLE_MODE, block, alignment,
        )  # fmt: skip
    except (TypeError, ValueError, AttributeError) as exc:  # a launcher we do not know
        logger.warning("direct Triton launch failed (%s); using the JIT dispatch", exc)
        _DIRECT = False
        return False
    return True


def launch_copy_kernel(
    ref_table: torch.Tensor,
    job_table: torch.Tensor,
    *,
    n_groups: int,
    n_units: int,
    total_pairs: int,
    max_size: int,
    src_factor: int,
    dst_factor: int,
    alignment: int,
    config: KernelConfig = DEFAULT_KERNEL_CONFIG,
    stream: int | None = None,
    job_offset: int = 0,
) -> Any:
    """Launch on ``stream`` (a raw CUDA stream handle; default: the current stream); both
    tables live on the GPU, the job's from entry ``job_offset`` of ``job_table``."""
    if triton is None:  # pragma: no cover
        raise RuntimeError(f"triton is not available: {_TRITON_ERROR}")
    if total_pairs <= 0:
        return None
    block = config.block_bytes
    chunks = -(-max_size // block)
    total_work = total_pairs * chunks
    programs = total_work
    device = ref_table.device
    if config.ctas_per_sm > 0:
        programs = min(total_work, config.ctas_per_sm * _num_sms(device))
    iters = -(-total_work // programs)
    key = (device.index or 0, block, alignment, config.num_warps)
    scalars = (n_groups, n_units, total_work, iters, chunks, src_factor, dst_factor)
    if stream is None and _DIRECT and key in _COMPILED:
        stream = torch.cuda.current_stream(device).cuda_stream
    if stream is not None and _launch_direct(
        key, programs, stream, ref_table.data_ptr(), job_table.data_ptr() + 8 * job_offset,
        scalars, block, alignment,
    ):  # fmt: skip
        return _COMPILED[key]
    # The JIT launches on torch's current stream: make that the stream the caller named, or
    # the kernel would race the table upload enqueued there.
    with torch.cuda.stream(
        torch.cuda.ExternalStream(stream, device=device) if stream is not None else None
    ):
        kernel = _uva_copy_kernel[(programs,)](
            ref_table,
            job_table[job_offset:],
            *scalars,
            *_TABLE_MODE,
            BLOCK=block,
            ALIGN=alignment,
            num_warps=config.num_warps,
        )
    if _DIRECT and kernel is not None and hasattr(kernel, "packed_metadata"):
        _COMPILED[key] = kernel
    return kernel


class BoundCopyKernel:
    """The copy kernel of one handler direction: ref table, factors, alignment and config
    fixed, so a launch computes only what depends on the job (on the H200 host the generic
    :func:`launch_copy_kernel` spent 4-5 us of a lone job's host time around the launcher's
    own 4 us).
    """

    def __init__(
        self,
        ref_table: torch.Tensor,
        *,
        src_factor: int,
        dst_factor: int,
        alignment: int,
        config: KernelConfig = DEFAULT_KERNEL_CONFIG,
    ) -> None:
        self.ref_table = ref_table
        self.config = config
        self._ref_ptr = ref_table.data_ptr()
        self._src_factor = src_factor
        self._dst_factor = dst_factor
        self._alignment = alignment
        device = ref_table.device
        self._device_index = device.index or 0
        self._grid = config.ctas_per_sm * _num_sms(device) if config.ctas_per_sm > 0 else 0
        self._key = (self._device_index, config.block_bytes, alignment, config.num_warps)

    @property
    def grid(self) -> int:
        """Persistent programs at most (0: one per work item)."""
        return self._grid

    @property
    def factors(self) -> tuple[int, int]:
        """Source and destination units per row."""
        return self._src_factor, self._dst_factor

    @property
    def direct(self) -> bool:
        """Whether launches skip the JIT (see :meth:`compiled`)."""
        return _DIRECT

    def compiled(self) -> Any:
        """The kernel the JIT compiled for this direction, once a launch compiled it and only
        where the direct launch is on (a Triton release whose launcher we checked); else
        None."""
        return _COMPILED.get(self._key) if _DIRECT else None

    def launch(
        self,
        job_table: torch.Tensor,
        *,
        n_groups: int,
        n_units: int,
        total_pairs: int,
        max_size: int,
        stream: int,
        job_offset: int = 0,
    ) -> None:
        """Launch over ``job_table`` (from entry ``job_offset``) on the raw ``stream``."""
        if total_pairs <= 0:
            return
        block = self.config.block_bytes
        chunks = -(-max_size // block)
        total_work = total_pairs * chunks
        grid = self._grid
        programs = min(total_work, grid) if grid else total_work
        scalars = (
            n_groups, n_units, total_work, -(-total_work // programs), chunks,
            self._src_factor, self._dst_factor,
        )  # fmt: skip
        job_ptr = job_table.data_ptr() + 8 * job_offset
        if _launch_direct(
            self._key, programs, stream, self._ref_ptr, job_ptr, scalars, block, self._alignment
        ):
            return
        launch_copy_kernel(
            self.ref_table,
            job_table,
            n_groups=n_groups,
            n_units=n_units,
            total_pairs=total_pairs,
            max_size=max_size,
            src_factor=self._src_factor,
            dst_factor=self._dst_factor,
            alignment=self._alignment,
            config=self.config,
            stream=stream,
            job_offset=job_offset,
        )
