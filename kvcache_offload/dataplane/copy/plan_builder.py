"""Build and check one job's :class:`~kvcache_offload.dataplane.copy.plan.TransferPlan`.

A handler keeps one :class:`PlanBuilder`: the per-group checks of the geometry run once, and
a job's own work is the block-id arithmetic of :mod:`kvcache_offload.dataplane.copy.plan`'s
vocabulary plus one bounds check per side. :func:`parse_job` reads the block ids out of a
(source, destination) spec pair.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvcache_offload.contracts.load_store_spec import (
    BlockIDsLoadStoreSpec,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
)
from kvcache_offload.dataplane.copy.plan import (
    GroupPlan,
    SideGeometry,
    TransferPlan,
    alignment_of,
)
from kvcache_offload.errors import TransferError

try:  # the host-copy extension's planner for one-group jobs (a few us less per job)
    from kvcache_offload.dataplane.copy._hostcopy import plan_units as _plan_units
except ImportError:  # pragma: no cover - exercised where the extension is not built
    _plan_units = None

__all__ = ["PlanBuilder", "build_plan", "parse_job"]

_INT64 = np.dtype(np.int64)


@dataclass(frozen=True)
class _GroupFacts:
    """What a job of one group always has in common, checked once per handler."""

    tensors: np.ndarray
    sizes: np.ndarray
    bytes_per_unit: int
    distinct_sizes: frozenset[int]
    max_size: int
    align_bits: int


class PlanBuilder:
    """Builds the plans of one handler's jobs; the per-group checks run once, here.

    A job's own work is then the block-id arithmetic and one bounds check per side, which
    keeps the host cost of a small job (the common case in serving) to a few microseconds.
    """

    def __init__(
        self,
        group_refs: Sequence[tuple[np.ndarray, np.ndarray]],
        src: SideGeometry,
        dst: SideGeometry,
    ) -> None:
        self.src, self.dst = src, dst
        self.num_groups = len(group_refs)
        self._facts: list[_GroupFacts | None] = []
        for g, (tensors, sizes) in enumerate(group_refs):
            if len(tensors) == 0:
                self._facts.append(None)
                continue
            if int(sizes.min()) <= 0:
                raise TransferError(f"group {g}: page sizes must be > 0, got {sizes.tolist()}")
            for side, what in ((src, "source"), (dst, "destination")):
                if int(tensors.max()) >= len(side.base) or int(tensors.min()) < 0:
                    raise TransferError(
                        f"group {g} refers to canonical tensor {int(tensors.max())}, but the "
                        f"{what} side has {len(side.base)}"
                    )
                too_big = sizes > side.sub_bytes[tensors]
                if too_big.any():
                    i = int(np.argmax(too_big))
                    raise TransferError(
                        f"group {g}: page of {int(sizes[i])} bytes does not fit the {what} "
                        f"tensor {int(tensors[i])}'s page of "
                        f"{int(side.sub_bytes[tensors[i]])} bytes"
                    )
            self._facts.append(
                _GroupFacts(
                    tensors,
                    sizes,
                    int(sizes.sum()),
                    frozenset(int(x) for x in np.unique(sizes)),
                    int(sizes.max()),
                    int(np.bitwise_or.reduce(sizes)),
                )
            )
        # One group with refs (the common model): build() takes a loop-free path.
        only = self._facts[0] if self.num_groups == 1 else None
        self._single = only
        self._single_uniform = (
            next(iter(only.distinct_sizes)) if only and len(only.distinct_sizes) == 1 else None
        )
        self._single_alignment = alignment_of(only.align_bits) if only else 1
        self._single_parts: tuple[np.ndarray, np.ndarray, int, int, int] | None = (
            (only.tensors, only.sizes, len(only.tensors), only.bytes_per_unit, only.max_size)
            if only
            else None
        )
        """What a plan of the one group takes from its facts, read once per job."""
        self._unit_geometry = (src.factor, dst.factor, src.num_rows, dst.num_rows)
        """``plan_units``' geometry arguments (see :meth:`write_single_units`)."""

    @property
    def single_group(self) -> _GroupFacts | None:
        """The facts of the one group with refs, when the model has exactly one group."""
        return self._single

    def write_single_units(
        self, src_ids: np.ndarray, dst_ids: np.ndarray, size: int, start: int, out: np.ndarray
    ) -> bool:
        """Check a one-group job's ids and write its source then destination units into
        ``out`` (``2 * size`` int64 entries) in one C call; False when the C planner is not
        built or refuses the job (then :meth:`build` names what is wrong)."""
        if _plan_units is None or src_ids.dtype != _INT64 or dst_ids.dtype != _INT64:
            return False
        src, dst = self.src, self.dst
        try:
            ok = _plan_units(
                src_ids, dst_ids, size, start, src.factor, dst.factor,
                src.num_rows, dst.num_rows, out,
            )  # fmt: skip
        except (BufferError, ValueError):  # a strided id view (numpy raises ValueError)
            return False
        return bool(ok)

    def single_units(self, spec: tuple[object, object], gpu_to_cpu: bool) -> np.ndarray | None:
        """The units of the common job (the engine's own spec classes, one KV-cache group,
        native int64 ids the C planner accepts), checked: ``2 * size`` int64 entries, the
        source units then the destination units. None for any other job, and for one the C
        planner refuses: :meth:`plan_job`'s general path names what is wrong."""
        if self._single_parts is None or _plan_units is None:
            return None
        if type(spec) is not tuple or len(spec) != 2:
            return None
        if gpu_to_cpu:
            gpu_spec, cpu_spec = spec
        else:
            cpu_spec, gpu_spec = spec
        if type(gpu_spec) is not GPULoadStoreSpec or type(cpu_spec) is not CPULoadStoreSpec:
            return None
        sizes, starts = gpu_spec.group_sizes, gpu_spec.block_indices
        # The arrays as the specs hold them once built (no property call each).
        gpu_ids = gpu_spec._block_ids
        if gpu_ids is None:
            gpu_ids = gpu_spec.block_ids
        cpu_ids = cpu_spec._block_ids
        if cpu_ids is None:
            cpu_ids = cpu_spec.block_ids
        src_ids, dst_ids = (gpu_ids, cpu_ids) if gpu_to_cpu else (cpu_ids, gpu_ids)
        size = int(sizes[0]) if len(sizes) == 1 and len(starts) == 1 else 0
        if (
            size <= 0
            or src_ids.dtype is not _INT64
            or dst_ids.dtype is not _INT64
            or src_ids.ndim != 1
            or dst_ids.ndim != 1
        ):
            return None
        units = np.empty(2 * size, dtype=_INT64)
        try:
            ok = _plan_units(src_ids, dst_ids, size, int(starts[0]), *self._unit_geometry, units)
        except (BufferError, ValueError):  # a strided id view (numpy raises ValueError)
            return None
        return units if ok else None

    def plan_job(self, spec: tuple[object, object], gpu_to_cpu: bool) -> TransferPlan:
        """``build(*parse_job(spec, gpu_to_cpu))``: the plan of one job's (source,
        destination) spec pair, the common job from :meth:`single_units`; any other job
        takes :func:`parse_job` and :meth:`build`, which name what is wrong."""
        units = self.single_units(spec, gpu_to_cpu)
        if units is not None:  # _single_plan inline
            parts = self._single_parts
            assert parts is not None
            tensors, ref_sizes, num_refs, unit_bytes, max_size = parts
            size = len(units) >> 1
            return TransferPlan(
                [GroupPlan(tensors, ref_sizes, units[:size], units[size:])],
                num_refs * size,
                unit_bytes * size,
                self._single_uniform,
                max_size,
                self._single_alignment,
            )
        return self.build(*parse_job(spec, gpu_to_cpu))

    def build(
        self,
        src_ids: np.ndarray,
        dst_ids: np.ndarray,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
    ) -> TransferPlan:
        """Validate one job against the geometry and compute its fragments.

        Raises :class:`TransferError` naming the offending value when the specs do not fit.
        """
        src, dst = self.src, self.dst
        if src_ids.ndim != 1 or dst_ids.ndim != 1:
            raise TransferError("block ids must be 1-D")
        if len(group_sizes) != self.num_groups or len(block_indices) != self.num_groups:
            raise TransferError(
                f"the job names {len(group_sizes)} group sizes and {len(block_indices)} block "
                f"indices, expected one per KV-cache group ({self.num_groups})"
            )
        single = self._single
        if single is not None:
            # One C call checks the ids and writes both sides' units; a job it refuses takes
            # the path below, which names what is wrong.
            size = int(group_sizes[0])
            if size > 0 and src_ids.dtype is _INT64 and dst_ids.dtype is _INT64:
                # write_single_units inline (the common job: native int64 ids): no method
                # call, the geometry's four numbers read once per handler.
                units = np.empty(2 * size, dtype=_INT64)
                try:
                    ok = _plan_units is not None and _plan_units(
                        src_ids, dst_ids, size, int(block_indices[0]), *self._unit_geometry, units
                    )
                except (BufferError, ValueError):  # a strided id view (numpy raises ValueError)
                    ok = False
                if ok:
                    return self._single_plan(single, units[:size], units[size:])
            else:
                units = np.empty(2 * max(size, 0), dtype=np.int64)
                if self.write_single_units(src_ids, dst_ids, size, int(block_indices[0]), units):
                    return self._single_plan(single, units[:size], units[size:])
        _check_ids(src_ids, src.num_rows, "source")
        _check_ids(dst_ids, dst.num_rows, "destination")
        if single is not None and group_sizes[0] > 0 and block_indices[0] >= 0:
            size, start = int(group_sizes[0]), int(block_indices[0])
            s_units, s_n = _side_units(src_ids, 0, size, start % src.factor, src.factor, "source")
            d_units, d_n = _side_units(
                dst_ids, 0, size, start % dst.factor, dst.factor, "destination"
            )
            _check_consumed(s_n, d_n, src_ids, dst_ids)
            return self._single_plan(single, s_units, d_units)
        src_off = dst_off = 0
        groups: list[GroupPlan] = []
        sizes_seen: set[int] = set()
        max_size = align_bits = num_fragments = num_bytes = 0
        for g, (size, start) in enumerate(zip(group_sizes, block_indices, strict=True)):
            size, start = int(size), int(start)
            if size < 0 or start < 0:
                raise TransferError(f"group {g}: size {size} and start index {start} must be >= 0")
            if size == 0:
                continue
            s_units, s_n = _side_units(
                src_ids, src_off, size, start % src.factor, src.factor, "source"
            )
            d_units, d_n = _side_units(
                dst_ids, dst_off, size, start % dst.factor, dst.factor, "destination"
            )
            src_off += s_n
            dst_off += d_n
            facts = self._facts[g]
            if facts is None:
                continue
            groups.append(GroupPlan(facts.tensors, facts.sizes, s_units, d_units, g))
            sizes_seen |= facts.distinct_sizes
            max_size = max(max_size, facts.max_size)
            align_bits |= facts.align_bits
            num_fragments += len(facts.tensors) * size
            num_bytes += facts.bytes_per_unit * size
        _check_consumed(src_off, dst_off, src_ids, dst_ids)
        return TransferPlan(
            groups=groups,
            num_fragments=num_fragments,
            num_bytes=num_bytes,
            uniform_size=next(iter(sizes_seen)) if len(sizes_seen) == 1 else None,
            max_size=max_size,
            alignment=alignment_of(align_bits),
        )

    def units_plan(self, s_units: np.ndarray, d_units: np.ndarray) -> TransferPlan:
        """The plan of one-group jobs from their units, already checked (the units a
        handler wrote with :meth:`write_single_units`, several jobs' concatenated): a held
        batch that leaves as one plan then builds no plan per job and merges none."""
        single = self._single
        if single is None:
            raise TransferError("units_plan needs a handler of one KV-cache group with refs")
        return self._single_plan(single, s_units, d_units)

    def _single_plan(
        self, single: _GroupFacts, s_units: np.ndarray, d_units: np.ndarray
    ) -> TransferPlan:
        """The plan of a job of the one group with refs, from its checked units."""
        size = len(s_units)
        return TransferPlan(  # positional: keywords cost ~0.3 us on a per-job path
            [GroupPlan(single.tensors, single.sizes, s_units, d_units, 0)],
            len(single.tensors) * size,
            single.bytes_per_unit * size,
            self._single_uniform,
            single.max_size,
            self._single_alignment,
        )


def _check_consumed(src_off: int, dst_off: int, src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
    if src_off != len(src_ids) or dst_off != len(dst_ids):
        raise TransferError(
            f"the groups consume {src_off} source and {dst_off} destination block ids, but "
            f"the job names {len(src_ids)} and {len(dst_ids)}"
        )


def _check_ids(ids: np.ndarray, num_rows: int, what: str) -> None:
    n = len(ids)
    if n == 0:
        return
    if n <= 64:  # a serving job's few ids: plain min/max beat two numpy reductions
        values = ids.tolist()
        low, high = min(values), max(values)
    else:
        low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= num_rows:
        raise TransferError(
            f"{what} block ids must be in [0, {num_rows}), got {ids.min()}..{ids.max()}"
        )


def _side_units(
    ids: np.ndarray, offset: int, count: int, skip: int, factor: int, what: str
) -> tuple[np.ndarray, int]:
    """Units of ``count`` pieces starting ``skip`` units into block ``ids[offset]``."""
    n_blocks = -(-(count + skip) // factor)
    if offset + n_blocks > len(ids):
        raise TransferError(
            f"{what} spec has {len(ids)} block ids but the groups need at least {offset + n_blocks}"
        )
    blocks = ids[offset : offset + n_blocks]
    if factor == 1:
        return blocks.astype(np.int64, copy=True), n_blocks
    units = (blocks[:, None] * factor + np.arange(factor, dtype=np.int64)[None, :]).reshape(-1)
    return units[skip : skip + count], n_blocks


def build_plan(
    src_ids: np.ndarray,
    dst_ids: np.ndarray,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    group_refs: Sequence[tuple[np.ndarray, np.ndarray]],
    src: SideGeometry,
    dst: SideGeometry,
) -> TransferPlan:
    """One job's plan without a cached builder (handlers keep a :class:`PlanBuilder`)."""
    if len(group_sizes) != len(group_refs) or len(block_indices) != len(group_refs):
        raise TransferError(
            f"the job names {len(group_sizes)} group sizes and {len(block_indices)} block "
            f"indices, expected one per KV-cache group ({len(group_refs)})"
        )
    return PlanBuilder(group_refs, src, dst).build(src_ids, dst_ids, group_sizes, block_indices)


def parse_job(
    spec: tuple[object, object], gpu_to_cpu: bool
) -> tuple[np.ndarray, np.ndarray, tuple[int, ...], tuple[int, ...]]:
    """``(src ids, dst ids, group_sizes, block_indices)`` of a (src, dst) spec pair.

    The GPU-side spec must be a :class:`GPULoadStoreSpec` and the other side a block-id spec
    of medium "CPU"; raises :class:`TransferError` otherwise.
    """
    try:
        src, dst = spec
    except (TypeError, ValueError):
        raise TransferError(f"a job spec is a (source, destination) pair, got {spec!r}") from None
    gpu_spec, cpu_spec = (src, dst) if gpu_to_cpu else (dst, src)
    # The exact classes the engine passes are told apart by ``type`` first: an isinstance
    # against these ABCs runs the ABC machinery (~0.3 us each per job).
    if type(gpu_spec) is not GPULoadStoreSpec and not isinstance(gpu_spec, GPULoadStoreSpec):
        raise TransferError(
            f"the {'source' if gpu_to_cpu else 'destination'} of this handler must be a "
            f"GPULoadStoreSpec, got {type(gpu_spec).__name__}"
        )
    if type(cpu_spec) is not CPULoadStoreSpec and (
        not isinstance(cpu_spec, BlockIDsLoadStoreSpec) or cpu_spec.medium() != "CPU"
    ):
        raise TransferError(
            f"the {'destination' if gpu_to_cpu else 'source'} of this handler must be a "
            f"CPU block-id spec, got {type(cpu_spec).__name__}"
        )
    ids = gpu_spec.block_ids, cpu_spec.block_ids
    src_ids, dst_ids = ids if gpu_to_cpu else ids[::-1]
    return src_ids, dst_ids, gpu_spec.group_sizes, gpu_spec.block_indices
