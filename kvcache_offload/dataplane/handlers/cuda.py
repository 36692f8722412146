"""GPU<->CPU transfer handlers: vLLM's ``cpu/gpu_worker.py`` semantics at PCIe link speed.

One :class:`SingleDirectionOffloadingHandler` per direction over the same tensor lists:

* canonical int8 page views of the GPU KV cache; one CPU tensor per canonical tensor whose
  slot holds ``block_size_factor`` GPU pages back to back; per-group ``group_sizes`` and
  ``block_indices`` with skip counts; un-padded page sizes (padding is never copied); all of
  it computed once per job, vectorised (:mod:`kvcache_offload.dataplane.copy.plan`);
* one copy per job, picked per job by mean fragment size: one ``cudaMemcpyBatchAsync``
  (copy engines; large fragments); for small fragments the *staged* path (a device gather or
  scatter through a GPU staging ring plus one DMA per offloaded block,
  :mod:`kvcache_offload.dataplane.copy.staged`) when the CPU blocks are contiguous (block-major,
  the default) and its DMA pieces are large, else the Triton UVA kernel (one launch).
  Without Triton or pinned/mapped host memory the handler uses the DMA; without either it
  falls back to plain torch ops (:mod:`kvcache_offload.dataplane.copy.torch_copy`) on a worker
  thread;
* stores wait on the compute stream that is current at submission, so the KV is copied
  only after the model wrote it; each job waits on the previous job's end event, so jobs of
  one direction complete strictly in submission order; ``get_finished`` pops from the head
  only while the head's end event has fired, never blocking;
* the kernel's per-layer address table is built once per handler and kept on the GPU; per
  job only the block ids travel (a pinned host table and its device copy, pooled with the
  streams and CUDA events); times come from CUDA events.

Import this module only where torch is installed; ``kvcache_offload`` itself does not.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from kvcache_offload.contracts.handler import (
    OffloadingHandler,
    TransferResult,
    TransferSpec,
    TransferType,
)
from kvcache_offload.contracts.kv_caches import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
)
from kvcache_offload.dataplane.copy.dma import get_cuda_runtime
from kvcache_offload.dataplane.copy.plan import SideGeometry, TransferPlan, refs_arrays
from kvcache_offload.dataplane.copy.plan_builder import PlanBuilder, parse_job
from kvcache_offload.dataplane.copy.staged import (
    DEFAULT_STAGING_CONFIG,
    StagedCopier,
    StagedJob,
    StagingConfig,
)
from kvcache_offload.dataplane.copy.torch_copy import TorchCopier
from kvcache_offload.dataplane.copy.triton_kernel import (
    DEFAULT_KERNEL_CONFIG,
    GROUP_ROW,
    KernelConfig,
    launch_copy_kernel,
    triton_available,
)
from kvcache_offload.dataplane.handlers.cpu_backend import (
    CPU_TO_GPU,
    GPU_TO_CPU,
    ThreadedOffloadingHandler,
    allocate_cpu_tensors,
    canonical_int8_views,
)
from kvcache_offload.dataplane.handlers.held_jobs import HeldJobs
from kvcache_offload.errors import ConfigError, TransferError

if TYPE_CHECKING:
    from kvcache_offload.dataplane.memory.shared_offload_region import SharedOffloadRegion

__all__ = [
    "DEFAULT_DMA_MIN_FRAGMENT_BYTES",
    "CpuGpuOffloadingHandlers",
    "Mechanism",
    "SingleDirectionOffloadingHandler",
    "StagingConfig",
]

logger = logging.getLogger(__name__)

Mechanism = Literal["auto", "kernel", "dma", "staged", "hybrid", "torch"]

DEFAULT_DMA_MIN_FRAGMENT_BYTES = 1024 * 1024
"""``auto`` sends a job whose mean fragment is at least this large through the batched DMA,
smaller ones through the kernel. From bench.serving on an H200 (bench/RESULTS.md): with 8 KiB
fragments the DMA ran at 0.04-0.13 of the link against the kernel's 0.2-0.5; with 64 KiB
fragments the kernel led every stream by 10-35% and tied single jobs within the run-to-run
spread; with 2 MiB fragments the DMA led the streams (mixed: 0.60 against 0.44)."""
DEFAULT_HYBRID_DMA_SHARE = 0.0
"""Share of a kernel job's layers that ``auto`` hands to a concurrent DMA (0: none)."""
DEFAULT_STAGED_MIN_JOB_BYTES = 256 * 1024 * 1024
"""``auto`` sends a small-fragment job through the staged path only from this size on; a
smaller job goes through the kernel, which starts at once instead of queueing on the submit
thread (bench.serving, docs/transfers.md)."""

DEFAULT_BATCH_MAX_BYTES = 16 * 1024 * 1024
"""A batch is issued once it holds this many bytes, and larger jobs go alone: several
batches stay in flight, so the copy of one overlaps the host work of the next (one batch of
everything would leave the link idle while the host completes it and submits the next)."""

CompletionWait = Literal["blocking", "spin"]
"""How the completion watcher waits on a job's end event: ``blocking`` sleeps in the
driver (no CPU while copies run), ``spin`` busy-waits in the driver (one core per direction
while jobs are in flight, a few microseconds sooner)."""


class _TableSlot:
    """A pinned host pointer table and its device copy, owned by one job at a time."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.capacity = 0
        self.host: torch.Tensor | None = None
        self.host_np: np.ndarray | None = None
        self.dev: torch.Tensor | None = None
        self.host_ptr = 0
        self.dev_ptr = 0

    def ensure(self, entries: int, need_device: bool) -> np.ndarray:
        if entries > self.capacity:
            cap = max(entries, 3 * 4096)
            cap = 1 << (cap - 1).bit_length()
            self.host = torch.empty(cap, dtype=torch.int64, pin_memory=True)
            self.host_np = self.host.numpy()
            self.host_ptr = self.host.data_ptr()
            self.dev = None
            self.capacity = cap
        if need_device and self.dev is None:
            self.dev = torch.empty(self.capacity, dtype=torch.int64, device=self.device)
            self.dev_ptr = self.dev.data_ptr()
        assert self.host_np is not None
        return self.host_np


@dataclass
class _Transfer:
    jobs: list[tuple[int, int]]
    """``(job id, bytes)`` of every job this one copy carries (several when batched)."""
    stream: torch.cuda.Stream | None
    start_event: torch.cuda.Event
    end_event: torch.cuda.Event
    slot: _TableSlot | None
    mechanism: str
    side_stream: torch.cuda.Stream | None = None
    sync_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    staged: StagedJob | None = None
    """Set for staged jobs: issued (maybe later, by the submit thread) by the copier."""

    def issued(self) -> bool:
        return self.staged is None or self.staged.issued.is_set()

    def done(self) -> bool:
        """Issued and its end event fired (a job that failed to issue is done at once)."""
        if self.staged is not None:
            if not self.staged.issued.is_set():
                return False
            if not self.staged.end_recorded:
                return True
        return bool(self.end_event.query())

    def synchronize(self) -> None:
        if self.staged is not None:
            self.staged.issued.wait()
            if not self.staged.end_recorded:
                return
        self.end_event.synchronize()


class _CompletionWatcher:
    """One thread that waits on each job's end, in submission order, and reports it.

    ``synchronize`` on a CUDA event releases the GIL, so the wait costs the event loop
    nothing; after each wait the watcher also takes every later job that has already
    finished, then calls ``callback()`` once for all of them.
    """

    def __init__(self, callback: Callable[[], None], name: str) -> None:
        self._callback = callback
        self._cond = threading.Condition()
        self._queue: deque[_Transfer] = deque()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, transfer: _Transfer) -> None:
        with self._cond:
            self._queue.append(transfer)
            self._cond.notify()

    def close(self) -> None:
        """Stop after the jobs already queued finished (they are still reported)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                head = self._queue.popleft()
            try:
                head.synchronize()
            except Exception:
                logger.exception("waiting for a transfer's end failed")
            with self._cond:
                while self._queue and self._queue[0].done():
                    self._queue.popleft()
            try:
                self._callback()
            except Exception:
                logger.exception("completion callback raised; ignored")


class SingleDirectionOffloadingHandler(OffloadingHandler):
    """Copies jobs of one direction between GPU canonical tensors and CPU tensors."""

    def __init__(
        self,
        gpu_tensors: Sequence[torch.Tensor],
        cpu_tensors: Sequence[torch.Tensor],
        block_size_factor: int,
        kv_cache_groups_data_refs: Sequence[Sequence[CanonicalKVCacheRef]],
        gpu_to_cpu: bool,
        *,
        mechanism: Mechanism = "auto",
        dma_min_fragment_bytes: int = DEFAULT_DMA_MIN_FRAGMENT_BYTES,
        kernel_config: KernelConfig = DEFAULT_KERNEL_CONFIG,
        hybrid_dma_share: float = DEFAULT_HYBRID_DMA_SHARE,
        max_staging_bytes: int = 256 * 1024 * 1024,
        staging: StagingConfig = DEFAULT_STAGING_CONFIG,
        staged_min_job_bytes: int = DEFAULT_STAGED_MIN_JOB_BYTES,
        completion_wait: CompletionWait = "blocking",
        batch_max_bytes: int = DEFAULT_BATCH_MAX_BYTES,
    ) -> None:
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
        self.gpu_to_cpu = gpu_to_cpu
        self.transfer_type: TransferType = GPU_TO_CPU if gpu_to_cpu else CPU_TO_GPU
        self.device = gpu_tensors[0].device
        self.gpu_tensors = list(gpu_tensors)
        self.cpu_tensors = list(cpu_tensors)
        self.block_size_factor = factor
        src, dst = (gpu_tensors, cpu_tensors) if gpu_to_cpu else (cpu_tensors, gpu_tensors)
        src_factor, dst_factor = (1, factor) if gpu_to_cpu else (factor, 1)
        self.src_geom = SideGeometry.from_tensors(src, src_factor)
        self.dst_geom = SideGeometry.from_tensors(dst, dst_factor)
        self._group_refs = [refs_arrays(refs) for refs in kv_cache_groups_data_refs]
        self._planner = PlanBuilder(self._group_refs, self.src_geom, self.dst_geom)
        self.dma_min_fragment_bytes = int(dma_min_fragment_bytes)
        self.kernel_config = kernel_config
        if not 0.0 <= hybrid_dma_share < 1.0:
            raise ConfigError(f"hybrid_dma_share must be in [0, 1), got {hybrid_dma_share}")
        self.hybrid_dma_share = float(hybrid_dma_share)
        self.staged_min_job_bytes = int(staged_min_job_bytes)
        if completion_wait not in ("blocking", "spin"):
            raise ConfigError(f"completion_wait must be blocking or spin, got {completion_wait!r}")
        self._blocking_events = completion_wait == "blocking"

        self._runtime = get_cuda_runtime()
        self.kernel_ok, self.dma_ok, reasons = self._probe(cpu_tensors)
        self.staged_ok = self.dma_ok and triton_available()[0]
        if not self.staged_ok:
            reasons["staged"] = (
                "needs triton and cudaMemcpyBatchAsync: "
                + "; ".join(v for k, v in reasons.items() if k != "kernel")
                if not self.dma_ok
                else f"needs triton ({triton_available()[1]})"
            )
        self.mechanism = self._resolve(mechanism, reasons)

        self._lock = threading.Lock()
        self._transfers: deque[_Transfer] = deque()
        self._transfer_events: dict[int, torch.cuda.Event] = {}
        self._stream_pool: list[torch.cuda.Stream] = []
        self._event_pool: list[torch.cuda.Event] = []
        self._slot_pool: list[_TableSlot] = []
        self._side_stream_pool: list[torch.cuda.Stream] = []
        self._sync_event_pool: list[torch.cuda.Event] = []
        self._closed = False
        self._watcher: _CompletionWatcher | None = None
        self._batching = False
        self.batch_max_bytes = int(batch_max_bytes)
        self._held = HeldJobs()
        self.batches = 0
        self.batched_jobs = 0
        self.jobs_by_mechanism: dict[str, int] = {
            "kernel": 0,
            "dma": 0,
            "staged": 0,
            "hybrid": 0,
            "torch": 0,
        }
        self._ref_table: torch.Tensor | None = None
        self._ref_start = np.zeros(len(self._group_refs) + 1, dtype=np.int64)
        self._kernel_align = 1
        if self.kernel_ok and self.mechanism in ("auto", "kernel", "hybrid"):
            self._build_ref_table()
        self._staged: StagedCopier | None = None
        if self.mechanism == "staged" or (
            self.mechanism == "auto"
            and self.staged_ok
            and staging.auto_min_piece_bytes is not None
            and all(t.numel() == 0 or t.is_pinned() for t in cpu_tensors)
        ):
            assert self._runtime is not None
            self._staged = StagedCopier(
                gpu_tensors,
                cpu_tensors,
                factor,
                self._group_refs,
                gpu_to_cpu,
                self._runtime,
                config=staging,
                kernel_config=kernel_config,
            )

        self._fallback: ThreadedOffloadingHandler | None = None
        if self.mechanism == "torch":
            self._fallback = self._make_fallback(
                src, dst, src_factor, dst_factor, kv_cache_groups_data_refs, max_staging_bytes
            )

    # -- construction helpers ---------------------------------------------------------------
    def _probe(self, cpu_tensors: Sequence[torch.Tensor]) -> tuple[bool, bool, dict[str, str]]:
        reasons: dict[str, str] = {}
        triton_ok, why = triton_available()
        mapped = all(self._is_mapped(t) for t in cpu_tensors)
        kernel_ok = triton_ok and mapped
        if not triton_ok:
            reasons["kernel"] = why or "triton unavailable"
        elif not mapped:
            reasons["kernel"] = "CPU tensors are not pinned and mapped for the GPU"
        dma_ok = self._runtime is not None and self._runtime.has_batch_memcpy
        if not dma_ok:
            reasons["dma"] = (
                "cudaMemcpyBatchAsync unavailable (needs CUDA runtime >= 12.8)"
                if self._runtime is not None
                else "the CUDA runtime library could not be loaded"
            )
        return kernel_ok, dma_ok, reasons

    def _is_mapped(self, t: torch.Tensor) -> bool:
        if t.numel() == 0:
            return True
        if self._runtime is not None:
            return self._runtime.is_uva_mapped(t.data_ptr())
        return bool(t.is_pinned())

    def _resolve(self, wanted: Mechanism, reasons: dict[str, str]) -> str:
        if wanted == "kernel" and not self.kernel_ok:
            raise ConfigError(f"mechanism 'kernel' is unavailable: {reasons['kernel']}")
        if wanted == "dma" and not self.dma_ok:
            raise ConfigError(f"mechanism 'dma' is unavailable: {reasons['dma']}")
        if wanted == "staged" and not self.staged_ok:
            raise ConfigError(f"mechanism 'staged' is unavailable: {reasons['staged']}")
        if wanted == "hybrid" and not (self.kernel_ok and self.dma_ok):
            raise ConfigError(
                "mechanism 'hybrid' needs the kernel and the DMA: "
                + "; ".join(f"{k}: {v}" for k, v in reasons.items())
            )
        if wanted not in ("auto", "kernel", "dma", "staged", "hybrid", "torch"):
            raise ConfigError(
                f"mechanism must be auto, kernel, dma, staged, hybrid or torch, got {wanted!r}"
            )
        if wanted == "auto" and not (self.kernel_ok or self.dma_ok):
            logger.warning(
                "GPU<->CPU %s: no fast copy path (%s); using the plain-torch fallback",
                "store" if self.gpu_to_cpu else "load",
                "; ".join(f"{k}: {v}" for k, v in reasons.items()),
            )
            return "torch"
        return wanted

    def _build_ref_table(self) -> None:
        """One row per (group, ref): both sides' base, row stride, sub-block and the size."""
        src, dst = self.src_geom, self.dst_geom
        rows = []
        for g, (tensors, sizes) in enumerate(self._group_refs):
            self._ref_start[g + 1] = self._ref_start[g] + len(tensors)
            if len(tensors):
                rows.append(
                    np.stack(
                        [
                            src.base[tensors], src.row_stride[tensors], src.sub_bytes[tensors],
                            dst.base[tensors], dst.row_stride[tensors], dst.sub_bytes[tensors],
                            sizes, np.zeros_like(sizes),
                        ],
                        axis=1,
                    )
                )  # fmt: skip
        table = np.concatenate(rows) if rows else np.zeros((1, 8), dtype=np.int64)
        self._ref_table = torch.from_numpy(np.ascontiguousarray(table)).to(self.device)
        bits = 0
        for tensors, sizes in self._group_refs:
            for arr in (sizes, src.base[tensors], src.row_stride[tensors],
                        src.sub_bytes[tensors], dst.base[tensors], dst.row_stride[tensors],
                        dst.sub_bytes[tensors]):  # fmt: skip
                if len(arr):
                    bits |= int(np.bitwise_or.reduce(arr))
        align = 16
        while align > 1 and bits % align:
            align //= 2
        self._kernel_align = align

    def _make_fallback(
        self,
        src: Sequence[torch.Tensor],
        dst: Sequence[torch.Tensor],
        src_factor: int,
        dst_factor: int,
        refs: Sequence[Sequence[CanonicalKVCacheRef]],
        max_staging_bytes: int,
    ) -> ThreadedOffloadingHandler:
        copier = TorchCopier(src, dst, src_factor, dst_factor, max_staging_bytes=max_staging_bytes)
        stream = torch.cuda.Stream(self.device)
        device = self.device
        gpu_to_cpu = self.gpu_to_cpu

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
            src_tensors=src,
            dst_tensors=dst,
            src_factor=src_factor,
            dst_factor=dst_factor,
            group_data_refs=refs,
            gpu_to_cpu=gpu_to_cpu,
            run_plan=run,
            prepare=prepare,
            thread_name="kvoffload-cuda-" + ("store" if gpu_to_cpu else "load"),
        )

    # -- the handler contract ---------------------------------------------------------------
    def plan(self, spec: TransferSpec) -> TransferPlan:
        src_ids, dst_ids, group_sizes, block_indices = parse_job(spec, self.gpu_to_cpu)
        return self._planner.build(src_ids, dst_ids, group_sizes, block_indices)

    def choose_mechanism(self, plan: TransferPlan) -> str:
        if self.mechanism != "auto":
            return self.mechanism
        if self.dma_ok and plan.mean_fragment_bytes >= self.dma_min_fragment_bytes:
            return "dma"
        staged = self._staged
        if (
            staged is not None
            and staged.config.auto_min_piece_bytes is not None
            and (plan.num_bytes >= self.staged_min_job_bytes or not self.kernel_ok)
        ):
            pieces = staged.layout.estimated_pieces(plan, self.gpu_to_cpu)
            if pieces and plan.num_bytes / pieces >= staged.config.auto_min_piece_bytes:
                return "staged"
        if self.dma_ok and not self.kernel_ok:
            return "dma"
        if self.dma_ok and self.hybrid_dma_share > 0:
            return "hybrid"
        return "kernel"

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        if self._fallback is not None:
            ok = self._fallback.transfer_async(job_id, spec)
            self.jobs_by_mechanism["torch"] += 1
            return ok
        plan = self.plan(spec)
        with self._lock:
            if self._closed:
                raise TransferError(f"job {job_id}: the handler is shut down")
            if job_id in self._transfer_events or job_id in self._held:
                raise TransferError(f"job {job_id} is already in flight on this handler")
            if self._batching and self._can_batch(plan) and (self._transfers or self._held):
                # Copies are in flight: hold this job for the batch. On an idle link a job
                # goes out at once, so a lone request pays no extra loop iteration.
                dst = self._dst_blocks(plan)
                if self._held.writes_any(dst):
                    self._flush_locked()  # the later job must land after the earlier one
                self._held.add(job_id, plan, dst)
                if self._held.nbytes >= self.batch_max_bytes:
                    self._flush_locked()
                return True
            self._flush_locked()
            self._issue([(job_id, plan.num_bytes)], plan)
        return True

    # -- batching: the jobs submitted in one event-loop tick share one copy ----------------
    def set_batching(self, enabled: bool) -> None:
        """Hold kernel and DMA jobs until :meth:`flush` (the caller promises to call it soon,
        e.g. once per event-loop tick) and issue them as one copy. A batch is one launch and
        one end event for all its jobs, which is what lets dozens of small concurrent jobs
        reach the link; jobs still complete in submission order."""
        if self._fallback is not None:
            return
        if not enabled:
            self.flush()
        self._batching = enabled

    def flush(self) -> None:
        """Issue the held jobs now (a no-op when none is held)."""
        if self._held:
            with self._lock:
                self._flush_locked()

    def _can_batch(self, plan: TransferPlan) -> bool:
        mechanism = self.choose_mechanism(plan)
        return mechanism in ("kernel", "dma") and plan.num_bytes < self.batch_max_bytes

    def _dst_blocks(self, plan: TransferPlan) -> set[int]:
        factor = self.dst_geom.factor
        out: set[int] = set()
        for g in plan.groups:
            units = g.dst_units if factor == 1 else g.dst_units // factor
            out.update(units.tolist())
        return out

    def _flush_locked(self) -> None:
        held = self._held.take()
        if held:
            self._issue([(job_id, plan.num_bytes) for job_id, plan in held], HeldJobs.merged(held))

    def _issue(self, jobs: list[tuple[int, int]], plan: TransferPlan) -> None:
        mechanism = self.choose_mechanism(plan)
        if mechanism == "staged":
            self._submit_staged(jobs, plan)
        else:
            if self._transfers and not self._transfers[-1].issued():
                # The submit thread has not issued the previous (staged) job: its end
                # event is not recorded yet, and this job must wait on it.
                assert self._transfers[-1].staged is not None
                self._transfers[-1].staged.issued.wait()
            self._submit(jobs, plan, mechanism)
        self.jobs_by_mechanism[mechanism] += len(jobs)
        if len(jobs) > 1:
            self.batches += 1
            self.batched_jobs += len(jobs)

    def _submit(self, jobs: list[tuple[int, int]], plan: TransferPlan, mechanism: str) -> None:
        dma_part: TransferPlan | None = None
        kernel_part: TransferPlan | None = None
        if mechanism == "dma":
            dma_part = plan
        elif mechanism == "kernel":
            kernel_part = plan
        else:  # hybrid: some layers through the copy engines, the rest through the kernel
            dma_part, kernel_part = plan.split_refs(self.hybrid_dma_share)
            if not dma_part.num_fragments:
                dma_part = None
            if not kernel_part.num_fragments:
                kernel_part = None
        k_groups = kernel_part.groups if kernel_part is not None else []
        k_entries = GROUP_ROW * len(k_groups) + 2 * sum(len(g.src_units) for g in k_groups)
        n_dma = dma_part.num_fragments if dma_part is not None else 0
        slot: _TableSlot | None = None
        host: np.ndarray | None = None
        if k_entries or n_dma:
            slot = self._slot_pool.pop() if self._slot_pool else _TableSlot(self.device)
            host = slot.ensure(k_entries + 3 * n_dma, need_device=bool(k_entries))
        n_units = 0
        if k_groups and host is not None:
            n_units = self._fill_job_table(k_groups, host[:k_entries])
        dma_table: np.ndarray | None = None
        if dma_part is not None and host is not None:
            dma_table = dma_part.fill_pointer_table(
                self.src_geom,
                self.dst_geom,
                host[k_entries : k_entries + 3 * n_dma].reshape(3, n_dma),
            )
        stream = self._stream_pool.pop() if self._stream_pool else torch.cuda.Stream(self.device)
        start, end = self._timing_events()
        side: torch.cuda.Stream | None = None
        sync: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        if dma_table is not None and kernel_part is not None:
            side = (
                self._side_stream_pool.pop()
                if self._side_stream_pool
                else torch.cuda.Stream(self.device)
            )
            sp = self._sync_event_pool
            sync = (
                sp.pop() if sp else torch.cuda.Event(),
                sp.pop() if sp else torch.cuda.Event(),
            )
        # Every call below names its stream explicitly: no stream context to enter and leave
        # per job, and the table upload is one runtime call instead of a dispatched copy_.
        runtime = self._runtime
        handle = stream.cuda_stream
        with torch.cuda.device(self.device):
            if k_entries and slot is not None:
                assert slot.host is not None and slot.dev is not None
                if runtime is not None:
                    runtime.memcpy_async(slot.dev_ptr, slot.host_ptr, 8 * k_entries, handle)
                else:
                    with torch.cuda.stream(stream):
                        slot.dev[:k_entries].copy_(slot.host[:k_entries], non_blocking=True)
            if self.gpu_to_cpu:
                stream.wait_stream(torch.cuda.current_stream(self.device))
            if self._transfers:
                stream.wait_event(self._transfers[-1].end_event)
            start.record(stream)
            if dma_table is not None:
                dma_stream = stream
                if side is not None and sync is not None:
                    sync[0].record(stream)
                    side.wait_event(sync[0])
                    dma_stream = side
                assert runtime is not None
                runtime.memcpy_batch_async(
                    dma_table[1], dma_table[0], dma_table[2], dma_stream.cuda_stream
                )
            if kernel_part is not None and slot is not None:
                assert slot.dev is not None and self._ref_table is not None
                launch_copy_kernel(
                    self._ref_table,
                    slot.dev,
                    n_groups=len(k_groups),
                    n_units=n_units,
                    total_pairs=kernel_part.num_fragments,
                    max_size=kernel_part.max_size,
                    src_factor=self.src_geom.factor,
                    dst_factor=self.dst_geom.factor,
                    alignment=self._kernel_align,
                    config=self.kernel_config,
                    stream=handle,
                )
            if side is not None and sync is not None:
                sync[1].record(side)
                stream.wait_event(sync[1])
            end.record(stream)
        transfer = _Transfer(jobs, stream, start, end, slot, mechanism, side, sync)
        self._transfers.append(transfer)
        for job_id, _ in jobs:
            self._transfer_events[job_id] = end
        if self._watcher is not None:
            self._watcher.watch(transfer)

    def _submit_staged(self, jobs: list[tuple[int, int]], plan: TransferPlan) -> None:
        assert self._staged is not None
        start, end = self._timing_events()
        slot = self._slot_pool.pop() if self._slot_pool else _TableSlot(self.device)
        ready: torch.cuda.Event | None = None
        if self.gpu_to_cpu:
            sp = self._sync_event_pool
            ready = sp.pop() if sp else torch.cuda.Event()
            with torch.cuda.device(self.device):
                ready.record(torch.cuda.current_stream(self.device))
        prev = self._transfers[-1] if self._transfers else None
        job = StagedJob(
            plan,
            start,
            end,
            slot,
            ready_event=ready,
            prev_end=prev.end_event if prev is not None else None,
        )
        transfer = _Transfer(
            jobs,
            None,
            start,
            end,
            slot,
            "staged",
            None,
            None,
            job,
        )
        self._staged.submit(job)
        self._transfers.append(transfer)
        for job_id, _ in jobs:
            self._transfer_events[job_id] = end
        if self._watcher is not None:
            self._watcher.watch(transfer)

    def _timing_events(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """A job's start and end events (pooled); the watcher sleeps on the end event."""
        pool = self._event_pool
        if len(pool) >= 2:
            return pool.pop(), pool.pop()
        blocking = self._blocking_events
        return (
            torch.cuda.Event(enable_timing=True, blocking=blocking),
            torch.cuda.Event(enable_timing=True, blocking=blocking),
        )

    def _fill_job_table(self, groups: list[Any], out: np.ndarray) -> int:
        """Group rows then source and destination units; returns the number of units."""
        n_groups = len(groups)
        if n_groups == 1:  # the common case: four scalars and two unit runs, no reductions
            g = groups[0]
            n_units = len(g.src_units)
            out[0] = 0
            out[1] = n_units
            out[2] = self._ref_start[g.index] + g.ref_offset
            out[3] = 0
            out[GROUP_ROW : GROUP_ROW + n_units] = g.src_units
            out[GROUP_ROW + n_units : GROUP_ROW + 2 * n_units] = g.dst_units
            return n_units
        counts = np.fromiter((len(g.src_units) for g in groups), np.int64, n_groups)
        refs = np.fromiter((len(g.ref_tensors) for g in groups), np.int64, n_groups)
        n_units = int(counts.sum())
        rows = out[: GROUP_ROW * n_groups].reshape(n_groups, GROUP_ROW)
        pairs = counts * refs
        rows[0, 0] = 0
        np.cumsum(pairs[:-1], out=rows[1:, 0])
        rows[:, 1] = counts
        rows[:, 2] = [self._ref_start[g.index] + g.ref_offset for g in groups]
        rows[0, 3] = 0
        np.cumsum(counts[:-1], out=rows[1:, 3])
        base = GROUP_ROW * n_groups
        np.concatenate([g.src_units for g in groups], out=out[base : base + n_units])
        np.concatenate([g.dst_units for g in groups], out=out[base + n_units : base + 2 * n_units])
        return n_units

    def get_finished(self) -> list[TransferResult]:
        if self._fallback is not None:
            return self._fallback.get_finished()
        results = []
        with self._lock:
            while self._transfers and self._transfers[0].done():
                t = self._transfers.popleft()
                failed = t.staged is not None and t.staged.error is not None
                seconds = None if failed else t.start_event.elapsed_time(t.end_event) * 1e-3
                for job_id, nbytes in t.jobs:
                    results.append(
                        TransferResult(job_id, not failed, nbytes, seconds, self.transfer_type)
                    )
                self._recycle(t)
        return results

    def _recycle(self, t: _Transfer) -> None:
        if t.stream is not None:
            self._stream_pool.append(t.stream)
        self._event_pool.extend((t.start_event, t.end_event))
        if t.slot is not None:
            self._slot_pool.append(t.slot)
        if t.side_stream is not None:
            self._side_stream_pool.append(t.side_stream)
        if t.sync_events is not None:
            self._sync_event_pool.extend(t.sync_events)
        if t.staged is not None and t.staged.ready_event is not None:
            self._sync_event_pool.append(t.staged.ready_event)
        for job_id, _ in t.jobs:
            self._transfer_events.pop(job_id, None)

    def wait(self, job_ids: set[int]) -> None:
        if self._fallback is not None:
            self._fallback.wait(job_ids)
            return
        self.flush()
        with self._lock:
            waiting = [t for t in self._transfers if any(j in job_ids for j, _ in t.jobs)]
        for t in waiting:
            t.synchronize()

    def set_completion_callback(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback()`` from a watcher thread once jobs finished (None: stop).

        The watcher waits on each job's end event in submission order (sleeping in the
        driver with ``completion_wait="blocking"``), so nobody has to poll ``get_finished``.
        """
        if self._fallback is not None:
            self._fallback.set_completion_callback(callback)
            return
        with self._lock:
            watcher, self._watcher = self._watcher, None
            if callback is not None and not self._closed:
                self._watcher = _CompletionWatcher(
                    callback, "kvoffload-done-" + ("store" if self.gpu_to_cpu else "load")
                )
                for t in self._transfers:
                    self._watcher.watch(t)
        if watcher is not None:
            watcher.close()

    def pending_job_ids(self) -> list[int]:
        if self._fallback is not None:
            return self._fallback.pending_job_ids()
        with self._lock:
            return [j for j, _ in self._held.jobs] + [j for t in self._transfers for j, _ in t.jobs]

    def shutdown(self) -> None:
        """Wait for in-flight jobs, then drop them with every pooled resource. Idempotent."""
        if self._fallback is not None:
            self._fallback.shutdown()
        with self._lock:
            self._flush_locked()
            self._closed = True
            watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.close()
        with self._lock:
            if self._staged is not None:
                self._staged.close()  # issues what is queued, then stops its thread
            for t in self._transfers:
                t.synchronize()
            if self._staged is not None:
                self._staged.release()
            self._transfers.clear()
            self._transfer_events.clear()
            self._stream_pool.clear()
            self._event_pool.clear()
            self._slot_pool.clear()
            self._side_stream_pool.clear()
            self._sync_event_pool.clear()
            self._ref_table = None
            self.gpu_tensors = []
            self.cpu_tensors = []

    def describe(self) -> dict[str, Any]:
        return {
            "direction": "store" if self.gpu_to_cpu else "load",
            "mechanism": self.mechanism,
            "kernel_available": self.kernel_ok,
            "dma_available": self.dma_ok,
            "dma_min_fragment_bytes": self.dma_min_fragment_bytes,
            "hybrid_dma_share": self.hybrid_dma_share,
            "staged_min_job_bytes": self.staged_min_job_bytes,
            "completion_wait": "blocking" if self._blocking_events else "spin",
            "kernel_config": repr(self.kernel_config),
            "staging": self._staged.describe() if self._staged is not None else None,
            "jobs_by_mechanism": dict(self.jobs_by_mechanism),
            "batching": self._batching,
            "batches": self.batches,
            "batched_jobs": self.batched_jobs,
        }


class CpuGpuOffloadingHandlers:
    """The store (GPU->CPU) and load (CPU->GPU) handlers over one set of CPU tensors.

    ``cpu_tensors`` are pinned ``torch.zeros`` (one per canonical tensor, ``(num_cpu_blocks,
    gpu_page * block_size_factor)``) or views of ``mmap_region``, which is pinned (and mapped
    for the UVA kernel) here if it is not already; a pinning failure only warns.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        block_size_factor: int,
        num_cpu_blocks: int,
        mmap_region: SharedOffloadRegion | None = None,
        *,
        mechanism: Mechanism = "auto",
        dma_min_fragment_bytes: int = DEFAULT_DMA_MIN_FRAGMENT_BYTES,
        kernel_config: KernelConfig = DEFAULT_KERNEL_CONFIG,
        hybrid_dma_share: float = DEFAULT_HYBRID_DMA_SHARE,
        staging: StagingConfig = DEFAULT_STAGING_CONFIG,
        staged_min_job_bytes: int = DEFAULT_STAGED_MIN_JOB_BYTES,
        completion_wait: CompletionWait = "blocking",
        pin_memory: bool = True,
    ) -> None:
        self.gpu_tensors = canonical_int8_views(kv_caches)
        for i, t in enumerate(self.gpu_tensors):
            if t.device.type != "cuda":
                raise ConfigError(
                    f"CUDA handlers need CUDA tensors, canonical tensor {i} is on {t.device}; "
                    "use CpuBackendOffloadingHandlers for CPU tensors"
                )
        if mmap_region is not None and pin_memory and not mmap_region.is_pinned:
            mmap_region.pin()
        self.cpu_tensors = allocate_cpu_tensors(
            self.gpu_tensors, block_size_factor, num_cpu_blocks, mmap_region, pin_memory
        )
        kwargs: dict[str, Any] = {
            "mechanism": mechanism,
            "dma_min_fragment_bytes": dma_min_fragment_bytes,
            "kernel_config": kernel_config,
            "hybrid_dma_share": hybrid_dma_share,
            "staging": staging,
            "staged_min_job_bytes": staged_min_job_bytes,
            "completion_wait": completion_wait,
        }
        refs = kv_caches.group_data_refs
        self.gpu_to_cpu_handler = SingleDirectionOffloadingHandler(
            self.gpu_tensors, self.cpu_tensors, block_size_factor, refs, True, **kwargs
        )
        self.cpu_to_gpu_handler = SingleDirectionOffloadingHandler(
            self.gpu_tensors, self.cpu_tensors, block_size_factor, refs, False, **kwargs
        )

    @property
    def handlers(self) -> tuple[SingleDirectionOffloadingHandler, SingleDirectionOffloadingHandler]:
        return self.gpu_to_cpu_handler, self.cpu_to_gpu_handler

    def shutdown(self) -> None:
        for handler in self.handlers:
            handler.shutdown()
