"""Which copy paths a CUDA handler can use, and the tables and fallback they need.

Probed once per handler: the Triton UVA kernel needs Triton and CPU tensors that are pinned
and mapped for the GPU; the batched DMA needs ``cudaMemcpyBatchAsync`` (CUDA runtime >= 12.8);
the staged path needs both; without any of them the handler falls back to plain torch ops
on a worker thread. The per-job choice among the available paths is the handler's
(``choose_mechanism``), from the thresholds below.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from kvcache_offload.contracts.kv_caches import CanonicalKVCacheRef
from kvcache_offload.dataplane.copy.dma import CudaRuntime
from kvcache_offload.dataplane.copy.plan import CopySides, SideGeometry, TransferPlan
from kvcache_offload.dataplane.copy.torch_copy import TorchCopier
from kvcache_offload.dataplane.copy.triton_kernel import triton_available
from kvcache_offload.dataplane.handlers.threaded import ThreadedOffloadingHandler
from kvcache_offload.errors import ConfigError

__all__ = [
    "DEFAULT_STAGED_LONE_MAX_LOAD_BYTES",
    "DEFAULT_STAGED_LONE_MIN_LOAD_BYTES",
    "DEFAULT_STAGED_MIN_JOB_BYTES",
    "DEFAULT_STAGED_MIXED_MIN_JOB_BYTES",
    "DEFAULT_STAGED_ONE_WAY_MIN_LOAD_BYTES",
    "DEFAULT_STAGED_ONE_WAY_MIN_STORE_BYTES",
    "STAGED_WHEN_BUSY_CHOICES",
    "CompletionWait",
    "Mechanism",
    "StagedWhenBusy",
    "build_ref_table",
    "check_tensors",
    "make_torch_fallback",
    "probe_mechanism",
    "probe_paths",
    "resolve_mechanism",
    "staged_when_busy_per_direction",
]

logger = logging.getLogger(__name__)

Mechanism = Literal["auto", "kernel", "dma", "staged", "torch"]

DEFAULT_STAGED_MIN_JOB_BYTES = 256 * 1024 * 1024
"""``auto`` sends a small-fragment job through the staged path only from this size on; a
smaller job goes through the kernel, which starts at once instead of queueing on the submit
thread (bench.serving, docs/transfers.md)."""

DEFAULT_STAGED_LONE_MIN_LOAD_BYTES = 32 * 1024 * 1024
"""``auto`` sends a small-fragment load through the staged path (issued on the caller's
thread) from this size on, also when it finds its direction idle. On an H200 (bench.serving,
four runs, two per-layer layouts) 64-block loads (80-128 MiB) took 2-13 % less time staged
than through the kernel in 7 of 8 pairs (the eighth +3 %); 64-block stores were within -7 to
+4 %, so a lone store keeps the kernel below ``DEFAULT_STAGED_MIN_JOB_BYTES``."""
DEFAULT_STAGED_LONE_MAX_LOAD_BYTES = 256 * 1024 * 1024
"""A load that finds its direction idle takes the kernel from this size on, instead of the
staged path's submit thread (0: never). A restore of a returning conversation is such a load
(128-2,048 blocks of Llama-3.1-8B, 256 MiB-4 GiB): on an H100 (a probe through the public
API, default configuration) ``auto`` with a lower bound only sent them to the submit thread and took
2.0-2.8x the copy floor at 256 MiB-2 GiB, the kernel 1.11-1.17x, and at 4 GiB 1.04x against
the kernel's 1.10x. The submit thread takes the GIL between chunks while the caller's loop
looks for the job's end, so a job shorter than the caller's look (``poll_spin_s``, 20 ms)
waits on the GIL at every chunk."""
DEFAULT_STAGED_ONE_WAY_MIN_LOAD_BYTES = 5 * 1024 * 1024
"""Under ``staged_when_busy="mixed"``, a load queued behind loads also takes the staged path
while no store is copying, once the jobs of its copy average this many bytes (0: never).
H200, four runs: 4- and 8-block load streams (5-16 MiB jobs) at 0.93-1.02 of the link
against the kernel's 0.85-0.91; 1-block (1.25-2 MiB) jobs gain nothing staged, since the
staged path costs more host time per copy. At 4 MiB, an interleaved A/B (four passes) had
llama8b's loads at 43.2 GB/s staged against 48.7 with the kernel (every pass) and
cross_layer's at 49.6 against 48.5: the crossover lies between 4 and 5 MiB
(docs/transfers.md, "The `auto` rule (CUDA handlers)")."""
DEFAULT_STAGED_MIXED_MIN_JOB_BYTES = 5 * 1024 * 1024
"""Under "mixed", jobs that average this many bytes take the staged path whenever the other
direction is copying, on an idle direction too (its lone lane, and batches whose previous
copy ended). H200, six alternating passes: tp4_70b's mixed 4-block stream
sent 55 % of its 5 MiB stores through the kernel without it and 2 % with it; the stream's
rate moved within the passes' spread (1.17 against 1.11x one way, ahead in 4 of 6) and the
p99 of its jobs fell from 4.75 to 3.86 ms, cross_layer's from 5.78 to 4.48 ms."""
DEFAULT_STAGED_ONE_WAY_MIN_STORE_BYTES = 8 * 1024 * 1024
"""The same for stores queued behind stores. H200, four runs: 8-block store streams
(10-16 MiB jobs) at 0.95-1.01 of the link staged against the kernel's 0.90-0.94; 4-block
stores of 5 MiB (tp4_70b) gained in one run and lost in two."""

StagedWhenBusy = Literal["off", "stores", "both", "mixed"] | bool
"""Which directions ``auto`` sends through the staged path when the job queues behind copies
in flight (``True``/``False``: both/none); ``mixed``: both, but only while the other
direction has copies in flight too."""

STAGED_WHEN_BUSY_CHOICES = ("off", "stores", "both", "mixed")


def staged_when_busy_per_direction(setting: StagedWhenBusy) -> tuple[bool, bool]:
    """(stores, loads): whether each direction's handler takes the staged path when busy."""
    if isinstance(setting, bool):
        return setting, setting
    if setting not in STAGED_WHEN_BUSY_CHOICES:
        raise ConfigError(
            f"staged_when_busy must be one of {', '.join(STAGED_WHEN_BUSY_CHOICES)}, "
            f"got {setting!r}"
        )
    return setting != "off", setting in ("both", "mixed")


CompletionWait = Literal["blocking", "spin"]
"""How the completion watcher waits on a job's end event: ``blocking`` sleeps in the
driver (no CPU while copies run; through an :class:`~.end_wait.EndWait` where the C
extension is built, so the copies' own events need not be blocking-sync), ``spin``
busy-waits in the driver (one core per direction while jobs are in flight, a few
microseconds sooner)."""

_MECHANISMS = ("auto", "kernel", "dma", "staged", "torch")


def _is_mapped(runtime: CudaRuntime | None, t: torch.Tensor) -> bool:
    if t.numel() == 0:
        return True
    if runtime is not None:
        return runtime.is_uva_mapped(t.data_ptr())
    return bool(t.is_pinned())


def probe_paths(
    runtime: CudaRuntime | None, cpu_tensors: Sequence[torch.Tensor]
) -> tuple[bool, bool, dict[str, str]]:
    """``(kernel usable, DMA usable, reason per unusable path)``."""
    reasons: dict[str, str] = {}
    triton_ok, why = triton_available()
    mapped = all(_is_mapped(runtime, t) for t in cpu_tensors)
    kernel_ok = triton_ok and mapped
    if not triton_ok:
        reasons["kernel"] = why or "triton unavailable"
    elif not mapped:
        reasons["kernel"] = "CPU tensors are not pinned and mapped for the GPU"
    dma_ok = runtime is not None and runtime.has_batch_memcpy
    if not dma_ok:
        reasons["dma"] = (
            "cudaMemcpyBatchAsync unavailable (needs CUDA runtime >= 12.8)"
            if runtime is not None
            else "the CUDA runtime library could not be loaded"
        )
    return kernel_ok, dma_ok, reasons


def resolve_mechanism(
    wanted: Mechanism,
    *,
    kernel_ok: bool,
    dma_ok: bool,
    staged_ok: bool,
    reasons: dict[str, str],
    direction: str,
) -> str:
    """The configured mechanism, checked against what is available; ``auto`` without a fast
    path becomes ``torch`` (with a warning). Raises :class:`ConfigError` naming the reason."""
    if wanted == "kernel" and not kernel_ok:
        raise ConfigError(f"mechanism 'kernel' is unavailable: {reasons['kernel']}")
    if wanted == "dma" and not dma_ok:
        raise ConfigError(f"mechanism 'dma' is unavailable: {reasons['dma']}")
    if wanted == "staged" and not staged_ok:
        raise ConfigError(f"mechanism 'staged' is unavailable: {reasons['staged']}")
    if wanted not in _MECHANISMS:
        raise ConfigError(f"mechanism must be auto, kernel, dma, staged or torch, got {wanted!r}")
    if wanted == "auto" and not (kernel_ok or dma_ok):
        logger.warning(
            "GPU<->CPU %s: no fast copy path (%s); using the plain-torch fallback",
            direction,
            "; ".join(f"{k}: {v}" for k, v in reasons.items()),
        )
        return "torch"
    return wanted


def build_ref_table(
    group_refs: Sequence[tuple[np.ndarray, np.ndarray]],
    src: SideGeometry,
    dst: SideGeometry,
    device: torch.device,
) -> tuple[torch.Tensor, np.ndarray, int]:
    """The kernel's per-(group, ref) address table on the GPU, each group's first row, and
    the largest power of two (<= 16) dividing every address and size in it.

    One row per ref: both sides' base, row stride, sub-block and the size."""
    ref_start = np.zeros(len(group_refs) + 1, dtype=np.int64)
    rows = []
    bits = 0
    for g, (tensors, sizes) in enumerate(group_refs):
        ref_start[g + 1] = ref_start[g] + len(tensors)
        if not len(tensors):
            continue
        columns = [
            src.base[tensors], src.row_stride[tensors], src.sub_bytes[tensors],
            dst.base[tensors], dst.row_stride[tensors], dst.sub_bytes[tensors],
            sizes,
        ]  # fmt: skip
        rows.append(np.stack([*columns, np.zeros_like(sizes)], axis=1))
        for arr in columns:
            bits |= int(np.bitwise_or.reduce(arr))
    table = np.concatenate(rows) if rows else np.zeros((1, 8), dtype=np.int64)
    align = 16
    while align > 1 and bits % align:
        align //= 2
    return torch.from_numpy(np.ascontiguousarray(table)).to(device), ref_start, align


def make_torch_fallback(
    sides: CopySides,
    refs: Sequence[Sequence[CanonicalKVCacheRef]],
    *,
    gpu_to_cpu: bool,
    device: torch.device,
    max_staging_bytes: int,
) -> ThreadedOffloadingHandler:
    """The plain-torch path on a worker thread, for hosts without any fast path."""
    copier = TorchCopier(sides, max_staging_bytes=max_staging_bytes)
    stream = torch.cuda.Stream(device)

    def prepare() -> torch.cuda.Event | None:
        if not gpu_to_cpu:
            return None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        return ready

    def run(plan: TransferPlan, ready: torch.cuda.Event | None) -> None:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            copier.run(plan, stream)
            stream.synchronize()

    return ThreadedOffloadingHandler(
        sides=sides,
        group_data_refs=refs,
        gpu_to_cpu=gpu_to_cpu,
        run_plan=run,
        prepare=prepare,
        thread_name="kvoffload-cuda-" + ("store" if gpu_to_cpu else "load"),
    )


def check_tensors(
    gpu_tensors: Sequence[torch.Tensor], cpu_tensors: Sequence[torch.Tensor], block_size_factor: int
) -> int:
    """Check the tensor pairs every path copies between; returns the block size factor."""
    if not gpu_tensors or len(gpu_tensors) != len(cpu_tensors):
        raise ConfigError(
            f"need equal, non-empty tensor lists, got {len(gpu_tensors)} GPU and "
            f"{len(cpu_tensors)} CPU tensors"
        )
    factor = int(block_size_factor)
    if factor < 1:
        raise ConfigError(f"block_size_factor must be >= 1, got {block_size_factor}")
    for i, (g, c) in enumerate(zip(gpu_tensors, cpu_tensors, strict=True)):
        if g.dtype != torch.int8 or g.dim() != 2 or g.device.type != "cuda":
            raise ConfigError(
                f"GPU tensor {i} must be a 2-D int8 CUDA tensor, got {g.dtype} "
                f"{tuple(g.shape)} on {g.device}"
            )
        if c.dtype != torch.int8 or c.dim() != 2 or c.device.type != "cpu":
            raise ConfigError(
                f"CPU tensor {i} must be a 2-D int8 CPU tensor, got {c.dtype} "
                f"{tuple(c.shape)} on {c.device}"
            )
        if c.shape[1] != g.shape[1] * factor:
            raise ConfigError(
                f"CPU tensor {i}'s page of {c.shape[1]} bytes must be {factor} x the GPU "
                f"page of {g.shape[1]} bytes"
            )
    return factor


def probe_mechanism(
    runtime: CudaRuntime | None,
    cpu_tensors: Sequence[torch.Tensor],
    mechanism: Mechanism,
    gpu_to_cpu: bool,
) -> tuple[bool, bool, bool, str]:
    """(kernel usable, DMA usable, staged path usable, the mechanism ``mechanism`` resolves
    to) on this host; a forced path that is not usable raises :class:`ConfigError`."""
    kernel_ok, dma_ok, reasons = probe_paths(runtime, cpu_tensors)
    staged_ok = dma_ok and triton_available()[0]
    if not staged_ok:
        reasons["staged"] = (
            "needs triton and cudaMemcpyBatchAsync: "
            + "; ".join(v for k, v in reasons.items() if k != "kernel")
            if not dma_ok
            else f"needs triton ({triton_available()[1]})"
        )
    resolved = resolve_mechanism(
        mechanism,
        kernel_ok=kernel_ok,
        dma_ok=dma_ok,
        staged_ok=staged_ok,
        reasons=reasons,
        direction="store" if gpu_to_cpu else "load",
    )
    return kernel_ok, dma_ok, staged_ok, resolved
