"""vLLM's ``CpuGpuOffloadingHandlers`` call, answered by kvcache-offload through its vLLM adapter.

vLLM's test_gpu_worker.py builds vLLM's own handler pair. Its one changed line imports this
function instead, which builds the handlers the way vLLM's worker does once the config names our
spec: ``KVCacheOffloadSpec(vllm_config, kv_cache_config).get_handlers(kv_caches)`` (vLLM 0.21's
spec API). The test then drives the vLLM-facing handlers our adapter yields (``transfer_async``,
``get_finished``, ``shutdown``), with vLLM's own ``GPULoadStoreSpec`` / ``CPULoadStoreSpec``.

The test also reads four attributes of vLLM's handler class that no spec API promises; each is
answered from our handler pair, read-only:

* ``src_tensors`` / ``dst_tensors``: the GPU views and our CPU tensors, in copy direction;
* ``_transfers``: the jobs in flight (each with ``job_id``);
* ``kv_cache_groups_data_refs``: the per-group refs the handlers were built with.

``mmap_region`` (vLLM's shared region) is not used: with it, our spec is configured with
``shared_region`` and maps a region of its own (this library's ``SharedOffloadRegion``).
"""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import torch
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)

from kvcache_offload.integrations.vllm import KVCacheOffloadSpec

GPU_BLOCK_TOKENS = 16
"""Tokens per GPU block in the made-up KV-cache config; only the ratio to block_size matters."""


def CpuGpuOffloadingHandlers(  # named as the vLLM class it stands in for
    kv_caches: Any,
    block_size_factor: int,
    num_cpu_blocks: int,
    mmap_region: Any = None,
) -> SimpleNamespace:
    """Our handler pair, built through ``KVCacheOffloadSpec.get_handlers`` (vLLM 0.21)."""
    pages = [int(t.page_size_bytes) for t in kv_caches.tensors]
    num_gpu_blocks = int(kv_caches.tensors[0].tensor.shape[0])
    extra: dict[str, Any] = {
        "spec_name": "KVCacheOffloadSpec",
        "spec_module_path": "kvcache_offload.integrations.vllm",
        "block_size": GPU_BLOCK_TOKENS * block_size_factor,
        "cpu_bytes_to_use": num_cpu_blocks * sum(pages) * block_size_factor,
    }
    if mmap_region is not None:
        extra["shared_region"] = True
        extra["region_name"] = f"vllm-gpu-test-{uuid.uuid4().hex[:12]}"
    vllm_config = VllmConfig(
        cache_config=CacheConfig(block_size=GPU_BLOCK_TOKENS),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
    )
    spec = KVCacheOffloadSpec(vllm_config, _kv_cache_config(kv_caches, num_gpu_blocks))
    assert spec.num_blocks == num_cpu_blocks, (spec.num_blocks, num_cpu_blocks)
    (_, _, store), (_, _, load) = list(spec.get_handlers(kv_caches))
    pair = spec.backend.spec.build_handlers(None)  # cached: the pair behind those handlers
    refs = [list(group) for group in kv_caches.group_data_refs]
    return SimpleNamespace(
        gpu_to_cpu_handler=_Probe(store, pair, refs, gpu_to_cpu=True),
        cpu_to_gpu_handler=_Probe(load, pair, refs, gpu_to_cpu=False),
        spec=spec,
    )


def _kv_cache_config(kv_caches: Any, num_gpu_blocks: int) -> KVCacheConfig:
    """vLLM's KV-cache config for these tensors: one layer per canonical tensor, per group."""
    groups = []
    for g, refs in enumerate(kv_caches.group_data_refs):
        page = int(refs[0].page_size_bytes) if refs else 64
        head_size = max(page // (2 * GPU_BLOCK_TOKENS * 2), 1)  # K+V, fp16
        spec = FullAttentionSpec(
            block_size=GPU_BLOCK_TOKENS, num_kv_heads=1, head_size=head_size, dtype=torch.float16
        )
        groups.append(KVCacheGroupSpec([f"layer.{g}.{r.tensor_idx}" for r in refs], spec))
    tensors = [
        KVCacheTensor(size=int(t.page_size_bytes) * num_gpu_blocks, shared_by=[f"tensor.{i}"])
        for i, t in enumerate(kv_caches.tensors)
    ]
    return KVCacheConfig(
        num_blocks=num_gpu_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups
    )


class _Probe:
    """Our adapter's vLLM handler, plus the attributes vLLM's test reads off vLLM's class."""

    def __init__(self, handler: Any, pair: Any, refs: list[Any], *, gpu_to_cpu: bool) -> None:
        self._handler = handler
        self._pair = pair
        self._inner = pair.gpu_to_cpu_handler if gpu_to_cpu else pair.cpu_to_gpu_handler
        self.kv_cache_groups_data_refs = refs
        gpu, cpu = list(pair.gpu_tensors), list(pair.cpu_tensors)
        self.src_tensors, self.dst_tensors = (gpu, cpu) if gpu_to_cpu else (cpu, gpu)

    @property
    def _transfers(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(job_id=j) for j in self._inner.pending_job_ids()]

    def transfer_async(self, job_id: int, spec: Any) -> bool:
        return bool(self._handler.transfer_async(job_id, spec))

    def get_finished(self) -> list[Any]:
        return list(self._handler.get_finished())

    def wait(self, job_ids: set[int]) -> None:
        self._handler.wait(job_ids)

    def shutdown(self) -> None:
        self._handler.shutdown()
