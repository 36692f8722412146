"""One load job's copy, issued layer by layer in order, with a completion signal per layer.

A layer-wise load lets a model start layer i while later layers are still copying: the
model's stream waits on layer i's copy just before layer i's attention. This module moves
the bytes and decides nothing: the engine chose the keys, pinned the CPU slots and built the
job's (CPU spec, GPU spec) pair exactly as for a whole-job load; the load handler's planner
turns it into fragments, split here by layer (``refs_per_layer`` consecutive refs of the one
KV-cache group: 1 for one tensor per layer, 2 for separate K and V tensors).

Two ways to move them:

* CUDA handlers with the batched DMA: every layer's pieces go to the copy engines on one
  stream of this copier, one ``cudaMemcpyBatchAsync`` per layer, a CUDA event recorded after
  each. The copy engines leave every SM to the model that overlaps them.
  :meth:`LayerCopies.wait_layer` makes a stream wait on the event: no host synchronisation.
* Everything else (the CPU backend, the CUDA plain-torch fallback): the handler's own copy
  function runs layer after layer on this copier's thread, each setting a
  :class:`threading.Event`; :meth:`LayerCopies.wait_layer` waits on it on the host.

Either way layer i is complete before layer i + 1 (one stream, or one thread), and the jobs
of one copier complete in submission order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvcache_offload.dataplane.copy.plan import GroupPlan, TransferPlan
from kvcache_offload.errors import ConfigError, TransferError

__all__ = ["LayerCopier", "LayerCopies", "split_layers"]


def split_layers(plan: TransferPlan, refs_per_layer: int) -> list[TransferPlan]:
    """``plan`` (one KV-cache group) as one plan per layer, in layer order."""
    if refs_per_layer < 1:
        raise ConfigError(f"refs_per_layer must be >= 1, got {refs_per_layer}")
    if len(plan.groups) != 1:
        raise ConfigError(
            f"a layer-wise load needs one KV-cache group, this job has {len(plan.groups)}"
        )
    group = plan.groups[0]
    num_refs = len(group.ref_tensors)
    if num_refs % refs_per_layer:
        raise ConfigError(
            f"{num_refs} refs per block do not split into layers of {refs_per_layer} refs"
        )
    layers = []
    for start in range(0, num_refs, refs_per_layer):
        end = start + refs_per_layer
        part = GroupPlan(
            group.ref_tensors[start:end],
            group.ref_sizes[start:end],
            group.src_units,
            group.dst_units,
            group.index,
            group.ref_offset + start,
        )
        layers.append(TransferPlan.of_groups([part]))
    return layers


class LayerCopies:
    """The copies of one layer-wise job: per-layer completion, then the whole job's."""

    def __init__(self, num_layers: int, num_bytes: int) -> None:
        self.num_layers = num_layers
        self.num_bytes = num_bytes
        self.started = time.perf_counter()
        self.seconds = 0.0
        """Issue to the last layer's completion, once :meth:`finished` said so."""

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ConfigError(f"layer {layer} out of range: this job has {self.num_layers}")

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        """Make ``stream`` (CUDA; default the current one) wait for layer ``layer``'s copy,
        or, for host copies, return once it is done. Raises :class:`TransferError` when the
        layer was not copied (cancelled or failed)."""
        raise NotImplementedError

    def layer_done(self, layer: int) -> bool:
        """Whether layer ``layer``'s bytes are in place (never blocks)."""
        raise NotImplementedError

    def finished(self) -> bool | None:
        """None while copies are in flight; then True (every layer copied) or False."""
        raise NotImplementedError

    def cancel(self) -> None:
        """Copy no further layer where that is still possible (host copies); the layers
        not copied then fail their waits and the job finishes unsuccessful."""


class _DeviceLayerCopies(LayerCopies):
    def __init__(self, num_layers: int, num_bytes: int, events: list[Any], device: Any) -> None:
        super().__init__(num_layers, num_bytes)
        self._events = events
        self._device = device
        self._cancelled = False

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        self._check_layer(layer)
        import torch

        if stream is None:
            stream = torch.cuda.current_stream(self._device)
        stream.wait_event(self._events[layer])

    def layer_done(self, layer: int) -> bool:
        self._check_layer(layer)
        return bool(self._events[layer].query())

    def finished(self) -> bool | None:
        if self.seconds == 0.0:
            if not self._events[-1].query():
                return None
            self.seconds = time.perf_counter() - self.started
        return not self._cancelled

    def cancel(self) -> None:
        # Every layer is already on the copy engines; the job reports failure so the caller
        # does not read what it gave up on, and the slots stay pinned until the copy ends.
        self._cancelled = True


class _HostLayerCopies(LayerCopies):
    def __init__(self, num_layers: int, num_bytes: int) -> None:
        super().__init__(num_layers, num_bytes)
        self._done = [threading.Event() for _ in range(num_layers)]
        self._outcome = [False] * num_layers
        self._cancelled = threading.Event()
        self._ended = threading.Event()
        self.error: BaseException | None = None

    def run(self, layers: list[TransferPlan], copy: Callable[[TransferPlan], None]) -> None:
        """Copy the layers in order (on the copier's thread)."""
        try:
            for i, plan in enumerate(layers):
                if self._cancelled.is_set() or self.error is not None:
                    self._done[i].set()
                    continue
                try:
                    copy(plan)
                    self._outcome[i] = True
                except BaseException as exc:  # reported through finished() and the waits
                    self.error = exc
                self._done[i].set()
        finally:
            self.seconds = time.perf_counter() - self.started
            for event in self._done:
                event.set()
            self._ended.set()

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        self._check_layer(layer)
        self._done[layer].wait()
        if not self._outcome[layer]:
            why = "cancelled" if self.error is None else f"failed: {self.error}"
            raise TransferError(f"layer {layer} was not copied: the layer-wise load {why}")

    def layer_done(self, layer: int) -> bool:
        self._check_layer(layer)
        return self._done[layer].is_set() and self._outcome[layer]

    def finished(self) -> bool | None:
        if not self._ended.is_set():
            return None
        return all(self._outcome)

    def cancel(self) -> None:
        self._cancelled.set()


class LayerCopier:
    """Issues layer-wise copies for one load handler (see the module docstring).

    ``handler`` is the engine's CPU->GPU handler; the copier uses its planner, geometry and
    copy function, and its own stream (CUDA) or thread (host copies)."""

    def __init__(self, handler: Any) -> None:
        self._handler = handler
        self._runtime: Any = None
        self._stream: Any = None
        self._host_copy: Callable[[TransferPlan], None] | None = None
        self._pool: ThreadPoolExecutor | None = None
        fallback = getattr(handler, "_fallback", None)
        if hasattr(handler, "_launcher") and fallback is None:
            from kvcache_offload.dataplane.copy.dma import get_cuda_runtime

            self._runtime = get_cuda_runtime()
            if self._runtime is None:
                raise ConfigError("a layer-wise load on CUDA needs the CUDA runtime library")
        else:
            run_plan = getattr(fallback or handler, "_run_plan", None)
            if run_plan is None:
                raise ConfigError(
                    f"the load handler {type(handler).__name__} cannot copy layer by layer"
                )
            self._host_copy = lambda plan: run_plan(plan, None)

    @property
    def on_device(self) -> bool:
        """Whether waits are stream waits on CUDA events (else host waits)."""
        return self._runtime is not None

    def start(self, spec: Any, refs_per_layer: int = 1) -> LayerCopies:
        """Issue the (CPU spec, GPU spec) job ``spec`` layer by layer; returns at once."""
        layers = split_layers(self._handler.plan(spec), refs_per_layer)
        num_bytes = sum(p.num_bytes for p in layers)
        if self._runtime is not None:
            return self._start_device(layers, num_bytes)
        copies = _HostLayerCopies(len(layers), num_bytes)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvoffload-layerwise")
        host_copy = self._host_copy
        assert host_copy is not None
        self._pool.submit(copies.run, layers, host_copy)
        return copies

    def _start_device(self, layers: list[TransferPlan], num_bytes: int) -> LayerCopies:
        import torch

        handler = self._handler
        device = handler.device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        stream = self._stream
        raw = stream.cuda_stream
        events = []
        with torch.cuda.device(device):
            for plan in layers:
                table = np.empty((3, plan.num_fragments), dtype=np.int64)
                from kvcache_offload.dataplane.copy.dma import coalesce_pieces

                pieces = coalesce_pieces(
                    plan.fill_pointer_table(handler.src_geom, handler.dst_geom, table)
                )
                pieces = np.ascontiguousarray(pieces)
                if self._runtime.has_batch_memcpy:
                    self._runtime.memcpy_pieces(pieces[1], pieces[0], pieces[2], raw)
                else:  # one call per piece: correct, slower
                    for src, dst, size in pieces.T.tolist():
                        self._runtime.memcpy_async(dst, src, size, raw)
                event = torch.cuda.Event()
                event.record(stream)
                events.append(event)
        return _DeviceLayerCopies(len(layers), num_bytes, events, device)

    def close(self) -> None:
        """Stop the host thread after the jobs queued on it (CUDA copies end on their own)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
