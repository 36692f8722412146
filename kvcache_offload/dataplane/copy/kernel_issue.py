"""A direction's copy kernel bound to the C issuer: one call enqueues a whole kernel copy.

A lone serving job (1-8 blocks) that takes the kernel spent about 20 us of its submission on
the H200 host in five CUDA steps issued from Python: the job table's upload (ctypes), the
start event (torch), Triton's launcher with our binding around it (about 10 us), the end
event, and for a store the wait on the model's stream. :class:`KernelIssue` makes the same
calls, in the same order and on the same stream, from the ``_kernel_issue`` extension with
the GIL released once. A staged job of one chunk (the staged path's serving-size jobs) goes
out the same way: its waits and events, the table upload, the gather or scatter kernel and
up to :data:`MAX_PIECES` DMA pieces, one ``cudaMemcpyAsync`` each.

It binds only to what it can launch exactly as Triton does: a compiled kernel of one CTA per
program, no cooperative or programmatic launch, no global or profile scratch memory, and
parameter sizes the driver reports (``cuFuncGetParamInfo``, CUDA 12.4 and newer). Where any
of that is missing, or Triton launch hooks are installed (a profiler wants to see every
launch), the caller keeps issuing through Python and Triton's launcher.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from kvcache_offload.dataplane.copy.dma import CudaRuntime
from kvcache_offload.dataplane.copy.triton_kernel import (
    BoundCopyKernel,
    KernelConfig,
    launch_hooks_installed,
)

__all__ = [
    "MAX_PIECES",
    "KernelIssue",
    "bind_kernel_issue",
    "bind_when_compiled",
    "copy_seconds",
    "kernel_issue_available",
    "raw_event",
]

logger = logging.getLogger(__name__)

try:
    from kvcache_offload.dataplane.copy._kernel_issue import (
        KERNEL_ARGS,
        MAX_PARAMS,
        MAX_PIECES,
        STAGE_RANGE,
        KernelIssuer,
        copy_seconds,
    )
except ImportError:  # built without a C compiler: Python issues every copy
    KernelIssuer = None
    copy_seconds = None
    STAGE_RANGE = 7
    MAX_PIECES = 0
    KERNEL_ARGS = MAX_PARAMS = 0

_STAGES = {
    1: "uploading the job table (cudaMemcpyAsync)",
    2: "ordering the copy after the current stream (cudaEventRecord / cudaStreamWaitEvent)",
    3: "ordering the copy after the previous one (cudaStreamWaitEvent)",
    4: "recording the start event (cudaEventRecord)",
    5: "launching the copy kernel (cuLaunchKernel)",
    6: "recording the end event (cudaEventRecord)",
    8: "ordering the copy after the model's work (cudaStreamWaitEvent)",
    9: "handing over the staging buffer (cudaEventRecord / cudaStreamWaitEvent)",
    10: "copying a staged piece (cudaMemcpyAsync)",
    11: "making the kernel's device current (cudaGetDevice / cudaSetDevice)",
}
_CUDA_ERROR_INVALID_VALUE = 1


def raw_event(event: torch.cuda.Event, stream: torch.cuda.Stream) -> int:
    """``event``'s raw handle for the issuer; torch creates an event at its first record, so
    a new one is recorded once on ``stream`` first (the issuer's own record supersedes it;
    an event never recorded before is never waited on)."""
    handle = event.cuda_event
    if not handle:
        event.record(stream)
        handle = event.cuda_event
    return int(handle)


def kernel_issue_available() -> bool:
    """Whether the ``_kernel_issue`` extension is built."""
    return KernelIssuer is not None


class KernelIssue:
    """One direction's copy kernel, issued from C. :meth:`issue` returns False, having
    enqueued nothing, when the job must go through Triton's launcher instead."""

    def __init__(self, issuer: Any, runtime: CudaRuntime) -> None:
        self._issuer = issuer
        self._runtime = runtime
        self.units_ready = False
        """Whether :meth:`issue_units` can take jobs (after :meth:`set_units`)."""

    def set_units(
        self,
        *,
        src_rows: int,
        dst_rows: int,
        ref_row: int,
        pairs_per_unit: int,
        max_size: int,
        device: int,
    ) -> bool:
        """Let :meth:`issue_units` plan the one KV-cache group's jobs: each side's rows, the
        group's row in the ref table, its fragments per unit and their largest size, and the
        device the kernel belongs to. False (logged at debug level) where the runtime lacks
        the device calls; the caller then plans in Python."""
        lib = self._runtime.lib
        try:
            get_device, set_device = _address(lib.cudaGetDevice), _address(lib.cudaSetDevice)
            self._issuer.set_units(
                src_rows, dst_rows, ref_row, pairs_per_unit, max_size, device, get_device,
                set_device,
            )  # fmt: skip
        except (AttributeError, ValueError, TypeError) as exc:
            logger.debug("one-group jobs planned in Python: %s", exc)
            return False
        self.units_ready = True
        return True

    def issue_units(
        self,
        host_ptr: int,
        dev_ptr: int,
        capacity: int,
        src_ids: Any,
        dst_ids: Any,
        size: int,
        start: int,
        stream: int,
        before: int,
        mark: int,
        prev_end: int,
        start_event: int,
        end_event: int,
    ) -> bool:
        """Plan a one-group job of ``size`` pieces from ``start`` (its int64 block ids on
        each side) and issue it as :meth:`issue` does, in one C call: its units go to the
        kernel as parameters (up to ``INLINE_UNITS`` per side, no table uploaded) or into the
        job table at ``host_ptr`` (``capacity`` entries). False, having enqueued nothing,
        where the job is not one it takes (ids it refuses, a table too small, launch hooks,
        a value a parameter cannot hold): the caller's general path then plans it and names
        any error. Raises RuntimeError naming the call that failed."""
        if not self.units_ready or launch_hooks_installed():
            return False
        code = self._issuer.issue_units(
            host_ptr, dev_ptr, capacity, src_ids, dst_ids, size, start, stream, before, mark,
            prev_end, start_event, end_event,
        )  # fmt: skip
        return code >= 0 and self._outcome(code)

    def issue(
        self,
        host_ptr: int,
        dev_ptr: int,
        n_units: int,
        ref_row: int,
        pairs: int,
        max_size: int,
        stream: int,
        before: int,
        mark: int,
        prev_end: int,
        start: int,
        end: int,
    ) -> bool:
        """Write the job table's group row, upload it, order the copy (after ``before``'s
        work through ``mark``, where ``mark`` is set: ``before`` 0 is the default stream;
        after ``prev_end``, where set), record ``start``,
        launch, record ``end``, all on ``stream`` (raw handles). Raises RuntimeError naming
        the call that failed; the calls before it stay enqueued, as in the Python path."""
        if launch_hooks_installed():
            return False
        code = self._issuer.issue(
            host_ptr, dev_ptr, n_units, ref_row, pairs, max_size, stream, before, mark,
            prev_end, start, end,
        )  # fmt: skip
        return self._outcome(code)

    def issue_staged(self, *args: Any) -> bool:
        """A staged job of one chunk (``StagedCopier._issue``'s calls, in its order; the
        arguments are the extension's ``issue_staged``). False, having enqueued nothing,
        where Triton must launch; raises RuntimeError naming the call that failed."""
        if launch_hooks_installed():
            return False
        try:
            code = self._issuer.issue_staged(*args)
        except (TypeError, ValueError) as exc:  # refused before any CUDA call
            logger.debug("staged job issued from Python: %s", exc)
            return False
        return self._outcome(code)

    def _outcome(self, code: int) -> bool:
        if code == 0:
            return True
        stage, err = code >> 16, code & 0xFFFF
        if stage == STAGE_RANGE:
            return False
        what = _STAGES.get(stage, f"stage {stage}")
        detail = f"CUresult {err}" if stage == 5 else self._runtime.error_string(err)
        raise RuntimeError(f"{what} failed: {detail} ({err})")


def _param_sizes(cuda: ctypes.CDLL, function: int) -> list[int] | None:
    """Each parameter's size in bytes, from the driver; None where it cannot say."""
    query = getattr(cuda, "cuFuncGetParamInfo", None)
    if query is None:
        return None
    query.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.POINTER(ctypes.c_size_t),
    ]
    query.restype = ctypes.c_int
    offset, size = ctypes.c_size_t(0), ctypes.c_size_t(0)
    sizes: list[int] = []
    for index in range(MAX_PARAMS + 1):
        code = query(function, index, ctypes.byref(offset), ctypes.byref(size))
        if code == _CUDA_ERROR_INVALID_VALUE:
            break
        if code != 0:
            return None
        sizes.append(int(size.value))
    return sizes


def _address(function: Any) -> int:
    return int(ctypes.cast(function, ctypes.c_void_p).value or 0)


def bind_kernel_issue(
    compiled: Any,
    runtime: CudaRuntime,
    *,
    ref_ptr: int,
    src_factor: int,
    dst_factor: int,
    config: KernelConfig,
    grid: int,
) -> KernelIssue | None:
    """Bind ``compiled`` (the Triton kernel the JIT compiled for this direction) to the C
    issuer; None, with the reason logged at debug level, where it cannot be launched the
    way Triton launches it."""
    if KernelIssuer is None:
        return None
    meta = getattr(compiled, "metadata", None)
    function = int(getattr(compiled, "function", 0) or 0)
    reason = ""
    if meta is None or not function:
        reason = "the compiled kernel has no metadata or function handle"
    elif getattr(meta, "num_ctas", 1) != 1:
        reason = "clusters of CTAs"
    elif getattr(meta, "launch_cooperative_grid", False) or getattr(meta, "launch_pdl", False):
        reason = "a cooperative or programmatic launch"
    elif getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        reason = "scratch memory"
    elif getattr(meta, "num_warps", config.num_warps) != config.num_warps:
        reason = "a warp count other than the configuration's"
    if reason or meta is None:
        logger.debug("copy kernel issued through Triton: %s", reason)
        return None
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        logger.debug("copy kernel issued through Triton: %s", exc)
        return None
    sizes = _param_sizes(cuda, function)
    # The kernel's own KERNEL_ARGS (two table pointers, seven ints, ref_row and the inline
    # units of each side), then Triton's scratch pointers, MAX_PARAMS at most.
    if sizes is None or not KERNEL_ARGS <= len(sizes) <= MAX_PARAMS or sizes[:2] != [8, 8]:
        logger.debug("copy kernel issued through Triton: parameter sizes %s", sizes)
        return None
    lib = runtime.lib
    try:
        issuer = KernelIssuer(
            memcpy_async=runtime.memcpy_address,
            event_record=_address(lib.cudaEventRecord),
            stream_wait=_address(lib.cudaStreamWaitEvent),
            launch=_address(cuda.cuLaunchKernel),
            function=function,
            shared=int(meta.shared),
            threads=32 * config.num_warps,
            grid=grid,
            block_bytes=config.block_bytes,
            ref_ptr=ref_ptr,
            src_factor=src_factor,
            dst_factor=dst_factor,
            param_sizes=sizes,
        )
    except (ValueError, TypeError, AttributeError) as exc:
        logger.debug("copy kernel issued through Triton: %s", exc)
        return None
    return KernelIssue(issuer, runtime)


def bind_when_compiled(
    kernel: BoundCopyKernel, runtime: CudaRuntime
) -> tuple[KernelIssue | None, bool]:
    """``kernel`` bound to the C issuer once a launch compiled it (the first copy launches
    through Triton), and whether to try again at a later copy: only while it is not compiled
    yet and Triton's direct launch is on."""
    compiled = kernel.compiled()
    if compiled is None:
        return None, kernel.direct
    src_factor, dst_factor = kernel.factors
    issue = bind_kernel_issue(
        compiled,
        runtime,
        ref_ptr=kernel.ref_table.data_ptr(),
        src_factor=src_factor,
        dst_factor=dst_factor,
        config=kernel.config,
        grid=kernel.grid,
    )
    return issue, False
