"""Issue one copy: the kernel, the batched DMA or the staged path.

The handler decides which jobs go together and by which path; :class:`CopyLauncher` only
moves the bytes. It fills the job's tables, takes a stream and events from the pools and
enqueues the copy behind the previous one of its direction, every call on an explicit
stream, and returns the :class:`~.inflight.InFlightCopy` that the handler then tracks.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from kvcache_offload.dataplane.copy.dma import CudaRuntime, coalesce_pieces
from kvcache_offload.dataplane.copy.kernel_issue import (
    KernelIssue,
    bind_when_compiled,
    copy_seconds,
    kernel_issue_available,
    raw_event,
)
from kvcache_offload.dataplane.copy.plan import SideGeometry, TransferPlan
from kvcache_offload.dataplane.copy.staged import (
    ISSUED_NOW,
    StagedCopier,
    StagedJob,
    StagingConfig,
)
from kvcache_offload.dataplane.copy.triton_kernel import (
    GROUP_ROW,
    BoundCopyKernel,
    KernelConfig,
    on_device,
)
from kvcache_offload.dataplane.handlers.cuda.inflight import (
    LANE_TABLE_ENTRIES,
    CopyPools,
    InFlightCopy,
    LaneCopy,
    TableSlot,
)
from kvcache_offload.dataplane.handlers.cuda.job_table import (
    fill_job_table,
    upload_table,
    write_group_row,
)
from kvcache_offload.dataplane.handlers.cuda.store_order import StoreOrder

__all__ = ["CopyLauncher"]


class CopyLauncher:
    """The per-handler state a copy needs: tables, pools, the runtime, the staged copier."""

    def __init__(
        self,
        *,
        device: torch.device,
        gpu_to_cpu: bool,
        src_geom: SideGeometry,
        dst_geom: SideGeometry,
        runtime: CudaRuntime | None,
        kernel_config: KernelConfig,
        pools: CopyPools,
    ) -> None:
        self.device = device
        self.gpu_to_cpu = gpu_to_cpu
        self.src_geom = src_geom
        self.dst_geom = dst_geom
        self.runtime = runtime
        self.kernel_config = kernel_config
        self.pools = pools
        self.ref_table: torch.Tensor | None = None
        self.ref_start = np.zeros(1, dtype=np.int64)
        self.kernel_align = 1
        self._staged: StagedCopier | None = None
        self._kernel: BoundCopyKernel | None = None
        self._order = StoreOrder(device, gpu_to_cpu, runtime)
        self._issue: KernelIssue | None = None
        """The kernel bound to the C issuer, once a launch compiled it (see ``_bind``)."""
        self._issue_unbound = kernel_issue_available() and runtime is not None
        """Whether to try binding it at the next lone copy."""
        self._ref_row = 0
        self._units_geometry: dict[str, int] | None = None
        """The one group's geometry for :meth:`lone_units` (see :meth:`plan_lone_units`)."""
        self._lane_stream: torch.cuda.Stream | None = None
        self._event_calls: tuple[int, int] | None = (
            runtime.event_calls if copy_seconds is not None and runtime is not None else None
        )
        """What :attr:`InFlightCopy.event_calls` holds for the copies issued from C."""

    def close(self) -> None:
        """Release the raw event and the tables (the handler's shutdown, after its copies
        ended)."""
        self._order.close()
        self._kernel = None
        self._issue = None
        self._issue_unbound = False
        self.ref_table = None

    def set_ref_table(self, table: torch.Tensor, ref_start: np.ndarray, align: int) -> None:
        self.ref_table, self.ref_start, self.kernel_align = table, ref_start, align
        self._ref_row = int(ref_start[0])
        self._issue = None
        self._issue_unbound = kernel_issue_available() and self.runtime is not None
        self._kernel = BoundCopyKernel(
            table,
            src_factor=self.src_geom.factor,
            dst_factor=self.dst_geom.factor,
            alignment=align,
            config=self.kernel_config,
        )

    def start_staged(
        self,
        gpu_tensors: Sequence[torch.Tensor],
        cpu_tensors: Sequence[torch.Tensor],
        factor: int,
        group_refs: Sequence[tuple[np.ndarray, np.ndarray]],
        staging: StagingConfig,
    ) -> StagedCopier:
        """Build the staged path's copier (its staging ring and submit thread)."""
        assert self.runtime is not None
        self._staged = StagedCopier(
            gpu_tensors,
            cpu_tensors,
            factor,
            group_refs,
            self.gpu_to_cpu,
            self.runtime,
            config=staging,
            kernel_config=self.kernel_config,
        )
        return self._staged

    def direct(
        self,
        jobs: list[tuple[int, int]],
        plan: TransferPlan,
        mechanism: str,
        prev: InFlightCopy | None,
    ) -> InFlightCopy:
        """Issue one kernel or DMA copy after ``prev`` (same direction) ended."""
        dma_part = plan if mechanism == "dma" else None
        kernel_part = plan if mechanism == "kernel" else None
        k_groups = kernel_part.groups if kernel_part is not None else []
        k_entries = GROUP_ROW * len(k_groups) + 2 * sum(len(g.src_units) for g in k_groups)
        n_dma = dma_part.num_fragments if dma_part is not None else 0
        slot: TableSlot | None = None
        host: np.ndarray | None = None
        if k_entries or n_dma:
            slot = self.pools.slot()
            host = slot.ensure(k_entries + 3 * n_dma, need_device=bool(k_entries))
        n_units = 0
        if k_groups and host is not None:
            n_units = fill_job_table(k_groups, self.ref_start, host[:k_entries])
        dma_table: np.ndarray | None = None
        if dma_part is not None and host is not None:
            dma_table = coalesce_pieces(
                dma_part.fill_pointer_table(
                    self.src_geom,
                    self.dst_geom,
                    host[k_entries : k_entries + 3 * n_dma].reshape(3, n_dma),
                )
            )
        stream = self.pools.stream()
        start, end = self.pools.timing_pair()
        # Every call below names its stream explicitly: no stream context to enter and leave
        # per job, and the table upload is one runtime call instead of a dispatched copy_.
        runtime = self.runtime
        handle = stream.cuda_stream
        with on_device(self.device):
            if k_entries and slot is not None:
                upload_table(self.runtime, slot, k_entries, stream)
            if self.gpu_to_cpu:
                self._order.after_current_stream(stream)
            if prev is not None:
                stream.wait_event(prev.end_event)
            start.record(stream)
            if dma_table is not None:
                assert runtime is not None
                runtime.memcpy_pieces(dma_table[1], dma_table[0], dma_table[2], handle)
            if kernel_part is not None and slot is not None:
                self._launch_kernel(
                    slot, len(k_groups), n_units, kernel_part.num_fragments,
                    kernel_part.max_size, handle,
                )  # fmt: skip
            end.record(stream)
        return InFlightCopy(jobs, stream, start, end, slot, mechanism)

    def lone_kernel(
        self,
        jobs: list[tuple[int, int]],
        slot: TableSlot,
        n_units: int,
        num_fragments: int,
        max_size: int,
        prev: InFlightCopy | None = None,
    ) -> InFlightCopy:
        """Issue a copy of the one group (group 0, no ref offset) after ``prev`` (same
        direction; None on an idle one), its ``n_units`` source then destination units
        already written to ``slot`` after the group row: a serving engine's lone request or
        a batch of one-group jobs, without the plan objects and the general path's checks
        (on the H200 host those cost about as much as the copy's CUDA calls). Issued from C
        in one call where the kernel is bound to the issuer (:mod:`..copy.kernel_issue`)."""
        assert slot.host_np is not None
        stream = self.pools.stream()
        start, end = self.pools.timing_pair()
        handle = stream.cuda_stream
        issue = self._issue if self._issue is not None or not self._issue_unbound else self._bind()
        if issue is not None:
            with on_device(self.device):
                raw_start, raw_end = raw_event(start, stream), raw_event(end, stream)
                after = 0 if prev is None else raw_event(prev.end_event, stream)
                if issue.issue(
                    slot.host_ptr, slot.dev_ptr, n_units, self._ref_row, num_fragments,
                    max_size, handle, *self._order.handles(), after,
                    raw_start, raw_end,
                ):  # fmt: skip
                    return InFlightCopy(
                        jobs, stream, start, end, slot, "kernel", raw_start=raw_start,
                        raw_end=raw_end, event_calls=self._event_calls,
                    )  # fmt: skip
        write_group_row(slot.host_np, n_units, self._ref_row)
        with on_device(self.device):
            upload_table(self.runtime, slot, GROUP_ROW + 2 * n_units, stream)
            if self.gpu_to_cpu:
                self._order.after_current_stream(stream)
            if prev is not None:
                stream.wait_event(prev.end_event)
            start.record(stream)
            self._launch_kernel(slot, 1, n_units, num_fragments, max_size, handle)
            end.record(stream)
        return InFlightCopy(jobs, stream, start, end, slot, "kernel")

    def plan_lone_units(
        self, *, src_rows: int, dst_rows: int, pairs_per_unit: int, max_size: int
    ) -> None:
        """Let lone one-group jobs be planned in the issuer's C call (:meth:`lone_units`)
        once the kernel is bound: each side's rows, the group's fragments per unit and their
        largest size."""
        self._units_geometry = {
            "src_rows": src_rows,
            "dst_rows": dst_rows,
            "pairs_per_unit": pairs_per_unit,
            "max_size": max_size,
        }

    def lone_units(
        self,
        jobs: list[tuple[int, int]],
        src_ids: np.ndarray,
        dst_ids: np.ndarray,
        size: int,
        start: int,
    ) -> InFlightCopy | None:
        """A lone one-group job on an idle direction, planned and issued in one C call
        (the issuer's ``issue_units``: the ids checked and turned into units in the job
        table, then :meth:`lone_kernel`'s CUDA calls) with a :class:`LaneCopy` kept whole
        between copies. None, having issued nothing, before the kernel is bound or where
        the call does not take the job; :meth:`lone_kernel` then issues it (and names any
        error). What it skips per job: a table, a stream and events from the pools, the
        units' own C call, the device guard, four raw handles and a new
        :class:`InFlightCopy` (docs/transfers.md)."""
        issue = self._issue if self._issue is not None or not self._issue_unbound else self._bind()
        if issue is None or not issue.units_ready:
            return None
        pools = self.pools
        lane = pools.lane_copies.pop() if pools.lane_copies else self._new_lane_copy()
        slot = lane.slot
        assert slot is not None
        before, mark = self._order.handles()
        if not issue.issue_units(
            slot.host_ptr, slot.dev_ptr, slot.capacity, src_ids, dst_ids, size, start,
            lane.raw_stream, before, mark, 0, lane.raw_start, lane.raw_end,
        ):  # fmt: skip
            pools.lane_copies.append(lane)
            return None
        lane.jobs = jobs
        lane.watched = False
        return lane

    def _new_lane_copy(self) -> LaneCopy:
        """A lane copy's stream (one per direction: its copies run one after another
        anyway), events and table, with their raw handles."""
        with on_device(self.device):
            if self._lane_stream is None:
                self._lane_stream = torch.cuda.Stream(self.device)
            stream = self._lane_stream
            start, end = self.pools.timing_pair()
            slot = TableSlot(self.device)
            slot.ensure(LANE_TABLE_ENTRIES, need_device=True)
            return LaneCopy(
                jobs=[], stream=stream, start_event=start, end_event=end, slot=slot,
                mechanism="kernel", raw_stream=int(stream.cuda_stream),
                raw_start=raw_event(start, stream), raw_end=raw_event(end, stream),
                event_calls=self._event_calls,
            )  # fmt: skip

    def _bind(self) -> KernelIssue | None:
        """Bind the kernel to the C issuer once the JIT compiled it (the first lone copy
        launches through Triton); a store also needs the raw ordering event."""
        kernel, runtime = self._kernel, self.runtime
        no_order = self.gpu_to_cpu and not self._order.raw
        if kernel is None or runtime is None or no_order:
            self._issue_unbound = False
            return None
        self._issue, self._issue_unbound = bind_when_compiled(kernel, runtime)
        geometry = self._units_geometry
        if self._issue is not None and geometry is not None:
            index = self.device.index
            self._issue.set_units(
                ref_row=self._ref_row,
                device=index if index is not None else torch.cuda.current_device(),
                **geometry,
            )
        return self._issue

    def _launch_kernel(
        self,
        slot: TableSlot,
        n_groups: int,
        n_units: int,
        total_pairs: int,
        max_size: int,
        stream: int,
    ) -> None:
        """The copy kernel over ``slot``'s uploaded job table, on the raw ``stream``."""
        assert slot.dev is not None and self._kernel is not None
        self._kernel.launch(
            slot.dev,
            n_groups=n_groups,
            n_units=n_units,
            total_pairs=total_pairs,
            max_size=max_size,
            stream=stream,
        )

    def staged(
        self,
        jobs: list[tuple[int, int]],
        plan: TransferPlan,
        prev: InFlightCopy | None,
        inline: bool = False,
    ) -> InFlightCopy:
        """Issue one staged copy after ``prev``: now (``inline``: the caller made sure
        ``prev`` is issued) or on the staged copier's submit thread. After another staged
        copy no event wait is needed: the copier's two streams keep its jobs in order."""
        assert self._staged is not None
        start, end = self.pools.timing_pair()
        slot = self.pools.slot()
        ready: torch.cuda.Event | None = None
        if self.gpu_to_cpu:
            ready = self.pools.sync_event()
            with on_device(self.device):
                ready.record(torch.cuda.current_stream(self.device))
        job = StagedJob(
            plan,
            start,
            end,
            slot,
            ready_event=ready,
            prev_end=prev.end_event if prev is not None and prev.staged is None else None,
            # Issued before this returns: no Event of its own to create and set.
            issued=ISSUED_NOW if inline else threading.Event(),
        )
        self._staged.submit(job, inline=inline)
        return InFlightCopy(jobs, None, start, end, slot, "staged", staged=job)
