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

Files: :mod:`.handler` (one direction: validation, path choice, batching, in-flight copies),
:mod:`.launch` (issuing one copy), :mod:`.inflight` (pooled per-copy resources and the
completion watcher), :mod:`.paths` (probing the paths, the kernel's tables, the fallback),
:mod:`.pair` (both directions). Import this package only where torch is installed;
``kvcache_offload`` itself does not.
"""

from kvcache_offload.dataplane.copy.staged import StagingConfig
from kvcache_offload.dataplane.handlers.cuda.handler import (
    DEFAULT_BATCH_MAX_BYTES,
    DEFAULT_BATCH_MIN_BYTES,
    SingleDirectionOffloadingHandler,
)
from kvcache_offload.dataplane.handlers.cuda.pair import CpuGpuOffloadingHandlers
from kvcache_offload.dataplane.handlers.cuda.paths import (
    DEFAULT_STAGED_MIN_JOB_BYTES,
    CompletionWait,
    Mechanism,
    StagedWhenBusy,
)

__all__ = [
    "DEFAULT_BATCH_MAX_BYTES",
    "DEFAULT_BATCH_MIN_BYTES",
    "DEFAULT_STAGED_MIN_JOB_BYTES",
    "CompletionWait",
    "CpuGpuOffloadingHandlers",
    "Mechanism",
    "SingleDirectionOffloadingHandler",
    "StagedWhenBusy",
    "StagingConfig",
]
