"""The CPU backend: the GPU<->CPU handler contract where the "GPU" tensors are CPU tensors.

It runs the whole offloading flow on machines without a GPU (CI, the default service) and is
byte-exact with the CUDA path: the same canonical views, the same CPU layout (one CPU tensor
per canonical tensor, ``block_size_factor`` pages per slot), the same fragment plan, the same
un-padded page sizes.

Copies run on one worker thread per direction (``concurrent.futures``), so jobs of one
direction complete strictly in submission order and a store never blocks the caller; loads
and stores run concurrently. Completion is read from the futures: ``get_finished`` never
blocks. The copy itself is :class:`~kvcache_offload.dataplane.copy.torch_copy.TorchCopier`
(vectorised ``index_select``/``index_copy_``), the same code that is the CUDA fallback.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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
from kvcache_offload.dataplane.copy.host_copy import HostCopier
from kvcache_offload.dataplane.copy.plan import SideGeometry, TransferPlan, refs_arrays
from kvcache_offload.dataplane.copy.plan_builder import PlanBuilder, parse_job
from kvcache_offload.dataplane.handlers.handler_pair import HandlerPair
from kvcache_offload.dataplane.handlers.held_jobs import HeldJobs
from kvcache_offload.errors import ConfigError, TransferError

if TYPE_CHECKING:
    from kvcache_offload.dataplane.memory.shared_offload_region import SharedOffloadRegion

__all__ = [
    "CpuBackendOffloadingHandlers",
    "ThreadedOffloadingHandler",
    "allocate_cpu_tensors",
    "canonical_int8_views",
]

logger = logging.getLogger(__name__)

HOST_BATCH_MAX_BYTES = 4 * 1024 * 1024
"""A batch of held jobs goes to the copy thread once it holds this many bytes, so the thread
copies one batch while the loop prepares the next."""
HOST_INLINE_MAX_BYTES = 256 * 1024
"""A job this small that finds the copy thread idle is copied at once on the submitting
thread: a ``memcpy`` of 256 KiB takes ~20 us, the hand-off to the copy thread and the
report back (two thread wake-ups and GIL hand-overs) cost several times that."""

GPU_TO_CPU: TransferType = ("GPU", "CPU")
CPU_TO_GPU: TransferType = ("CPU", "GPU")


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


@dataclass
class _Job:
    job_id: int
    num_bytes: int
    future: Future[float]


class ThreadedOffloadingHandler(OffloadingHandler):
    """One direction; each job runs on this handler's single worker thread.

    ``run_plan(plan)`` performs the copy and returns when the bytes are in place. Jobs finish
    in submission order; a job whose copy raises is reported with ``success=False``.
    """

    def __init__(
        self,
        *,
        src_tensors: Sequence[torch.Tensor],
        dst_tensors: Sequence[torch.Tensor],
        src_factor: int,
        dst_factor: int,
        group_data_refs: Sequence[Sequence[CanonicalKVCacheRef]],
        gpu_to_cpu: bool,
        run_plan: Callable[[TransferPlan, Any], None],
        prepare: Callable[[], Any] | None = None,
        thread_name: str = "kvoffload-copy",
        can_batch: bool = False,
        inline_max_bytes: int = 0,
    ) -> None:
        if not src_tensors or len(src_tensors) != len(dst_tensors):
            raise ConfigError(
                f"need equal, non-empty tensor lists, got {len(src_tensors)} source and "
                f"{len(dst_tensors)} destination tensors"
            )
        self.gpu_to_cpu = gpu_to_cpu
        self.transfer_type: TransferType = GPU_TO_CPU if gpu_to_cpu else CPU_TO_GPU
        self.src_geom = SideGeometry.from_tensors(src_tensors, src_factor)
        self.dst_geom = SideGeometry.from_tensors(dst_tensors, dst_factor)
        self._group_refs = [refs_arrays(refs) for refs in group_data_refs]
        self._planner = PlanBuilder(self._group_refs, self.src_geom, self.dst_geom)
        self._run_plan = run_plan
        self._prepare = prepare
        self._lock = threading.Lock()
        self._jobs: deque[_Job] = deque()
        self._pending: dict[int, _Job] = {}
        self._executor: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=thread_name
        )
        self._on_complete: Callable[[], None] | None = None
        self._can_batch = can_batch and prepare is None
        self._inline_max_bytes = inline_max_bytes if prepare is None else 0
        self._batching = False
        self._held = HeldJobs()

    def set_completion_callback(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback()`` (from the copy thread) each time a job finishes, so a poller
        can look at ``get_finished`` at once instead of on its next tick."""
        self._on_complete = callback

    def plan(self, spec: TransferSpec) -> TransferPlan:
        src_ids, dst_ids, group_sizes, block_indices = parse_job(spec, self.gpu_to_cpu)
        return self._planner.build(src_ids, dst_ids, group_sizes, block_indices)

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        plan = self.plan(spec)
        with self._lock:
            if self._executor is None:
                raise TransferError(f"job {job_id}: the handler is shut down")
            if job_id in self._pending or job_id in self._held:
                raise TransferError(f"job {job_id} is already in flight on this handler")
            if self._batching and (self._jobs or self._held):
                # Copies are queued or running: hold this job for the batch. An idle thread
                # gets the job at once, so a lone request pays no extra loop iteration.
                self._held.add(job_id, plan)
                if self._held.nbytes >= HOST_BATCH_MAX_BYTES:  # keep the thread fed meanwhile
                    self._issue(self._held.take())
                return True
            if not self._jobs and plan.num_bytes <= self._inline_max_bytes:
                self._run_inline(job_id, plan)
            else:
                self._issue([(job_id, plan)])
        return True

    def _run_inline(self, job_id: int, plan: TransferPlan) -> None:
        """Copy now on this thread (the copy thread is idle, so order is kept); the job is
        reported by the next ``get_finished`` like any other, after the completion callback."""
        future: Future[float] = Future()
        try:
            future.set_result(self._execute(plan, None))
        except Exception as exc:
            future.set_exception(exc)
        job = _Job(job_id, plan.num_bytes, future)
        self._jobs.append(job)
        self._pending[job_id] = job
        self._notify(future)

    def set_batching(self, enabled: bool) -> None:
        """Hold jobs until :meth:`flush` and run those held as one copy on the thread (one
        hand-off and one wake-up for all of them). Fragments are copied in submission order,
        so a later job still wins over an earlier one writing the same block."""
        if not self._can_batch:
            return
        if not enabled:
            self.flush()
        self._batching = enabled

    def flush(self) -> None:
        if self._held:
            with self._lock:
                held = self._held.take()
                if held and self._executor is not None:
                    self._issue(held)

    def _issue(self, jobs: list[tuple[int, TransferPlan]]) -> None:
        assert self._executor is not None
        plan = HeldJobs.merged(jobs)
        token = self._prepare() if self._prepare is not None else None
        future = self._executor.submit(self._execute, plan, token)
        future.add_done_callback(self._notify)
        for job_id, job_plan in jobs:
            job = _Job(job_id, job_plan.num_bytes, future)
            self._jobs.append(job)
            self._pending[job_id] = job

    def _notify(self, _future: Future[float]) -> None:
        callback = self._on_complete
        if callback is not None:
            try:
                callback()
            except Exception:
                logger.exception("completion callback raised; ignored")

    def _execute(self, plan: TransferPlan, token: Any) -> float:
        start = time.perf_counter()
        self._run_plan(plan, token)
        return time.perf_counter() - start

    def get_finished(self) -> list[TransferResult]:
        results = []
        with self._lock:
            while self._jobs and self._jobs[0].future.done():
                job = self._jobs.popleft()
                del self._pending[job.job_id]
                results.append(self._result(job))
        return results

    def _result(self, job: _Job) -> TransferResult:
        if job.future.cancelled():
            return TransferResult(job.job_id, False, job.num_bytes, None, self.transfer_type)
        exc = job.future.exception()
        if exc is not None:
            logger.warning("job %d (%s) failed: %s", job.job_id, self.transfer_type, exc)
            return TransferResult(job.job_id, False, job.num_bytes, None, self.transfer_type)
        return TransferResult(
            job.job_id, True, job.num_bytes, job.future.result(), self.transfer_type
        )

    def wait(self, job_ids: set[int]) -> None:
        self.flush()
        with self._lock:
            futures = [self._pending[j].future for j in job_ids if j in self._pending]
        if futures:
            wait_futures(futures)

    @property
    def num_pending(self) -> int:
        return len(self._jobs)

    def pending_job_ids(self) -> list[int]:
        with self._lock:
            return [j for j, _ in self._held.jobs] + [job.job_id for job in self._jobs]

    def shutdown(self) -> None:
        """Cancel jobs not started, wait for the running one, drop every job. Idempotent."""
        self.flush()
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._jobs.clear()
            self._pending.clear()


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
    ) -> None:
        self.gpu_tensors = canonical_int8_views(kv_caches)
        for i, t in enumerate(self.gpu_tensors):
            if t.device.type != "cpu":
                raise ConfigError(
                    f"the CPU backend needs CPU tensors, canonical tensor {i} is on {t.device}"
                )
        self.block_size_factor = int(block_size_factor)
        self.cpu_tensors = allocate_cpu_tensors(
            self.gpu_tensors, self.block_size_factor, num_cpu_blocks, mmap_region
        )
        refs = kv_caches.group_data_refs
        del max_staging_bytes  # the host copy needs no staging; kept for callers that pass it
        store = HostCopier(self.gpu_tensors, self.cpu_tensors, 1, self.block_size_factor)
        load = HostCopier(self.cpu_tensors, self.gpu_tensors, self.block_size_factor, 1)
        self.gpu_to_cpu_handler = ThreadedOffloadingHandler(
            src_tensors=self.gpu_tensors,
            dst_tensors=self.cpu_tensors,
            src_factor=1,
            dst_factor=self.block_size_factor,
            group_data_refs=refs,
            gpu_to_cpu=True,
            run_plan=lambda plan, _token: store.run(plan),
            thread_name="kvoffload-store",
            can_batch=True,
            inline_max_bytes=inline_max_bytes,
        )
        self.cpu_to_gpu_handler = ThreadedOffloadingHandler(
            src_tensors=self.cpu_tensors,
            dst_tensors=self.gpu_tensors,
            src_factor=self.block_size_factor,
            dst_factor=1,
            group_data_refs=refs,
            gpu_to_cpu=False,
            run_plan=lambda plan, _token: load.run(plan),
            thread_name="kvoffload-load",
            can_batch=True,
            inline_max_bytes=inline_max_bytes,
        )
