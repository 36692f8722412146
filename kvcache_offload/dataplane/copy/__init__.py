"""Copy paths of the GPU<->CPU handlers.

* :mod:`~kvcache_offload.dataplane.copy.plan` (torch-free): a job's fragments, vectorised.
* :mod:`~kvcache_offload.dataplane.copy.triton_kernel`: one persistent Triton UVA launch per job.
* :mod:`~kvcache_offload.dataplane.copy.dma`: one ``cudaMemcpyBatchAsync`` per job (ctypes).
* :mod:`~kvcache_offload.dataplane.copy.staged`: device gather/scatter through a GPU staging ring
  plus one DMA per (block-major) CPU block; its knobs in ``staging_config``, its cell geometry
  in ``staging_cells`` and its per-job tables (torch-free numpy) in ``staged_tables``.
* :mod:`~kvcache_offload.dataplane.copy.torch_copy`: the plain-torch fallback, also the CPU backend.

Only the torch-free planning names are exported here; import the others by module path.
"""

from kvcache_offload.dataplane.copy.plan import (
    GroupPlan,
    SideGeometry,
    TransferPlan,
    refs_arrays,
)
from kvcache_offload.dataplane.copy.plan_builder import build_plan, parse_job

__all__ = ["GroupPlan", "SideGeometry", "TransferPlan", "build_plan", "parse_job", "refs_arrays"]
