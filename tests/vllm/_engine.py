"""vLLM's real Scheduler and worker-side OffloadingConnector, stepped by hand on CPU tensors.

A stand-in for vLLM's model runner: each step it writes every scheduled token's KV slot with
bytes determined by (position, token id), so a prefix's KV is the same whichever request
computed it, and any block can be checked byte for byte against what it must hold.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest.mock import patch

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvcache_offload.integrations.vllm._versions import api_generation
from tests.vllm.conftest import MODEL

HANDLERS_API = api_generation() == "handlers"
"""vLLM 0.21: FlashAttention's (K/V, num_blocks, ...) layer tensors, found through the layer's
attention backend; 0.33: standardized (num_blocks, K/V, ...) tensors."""

SPEC = {
    "spec_name": "KVCacheOffloadSpec",
    "spec_module_path": "kvcache_offload.integrations.vllm",
}
WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker"
NUM_KV_HEADS = 2
HEAD_SIZE = 8
DTYPE = torch.float16


def vllm_config(
    extra_config: dict[str, Any], *, block_size: int = 16, kv_events: bool = False
) -> VllmConfig:
    model = ModelConfig(model=MODEL, dtype="float16", seed=0, max_model_len=4096)
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=1024,
            max_model_len=4096,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra_config,
        ),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=kv_events) if kv_events else None,
        device_config=DeviceConfig("cpu"),
    )
    config.scheduler_config.async_scheduling = False
    return config


def kv_cache_config(layers: list[str], num_blocks: int, block_size: int = 16) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=DTYPE
    )
    size = spec.page_size_bytes * num_blocks
    if HANDLERS_API:
        tensors = [KVCacheTensor(size=size, shared_by=[name]) for name in layers]
    else:
        # One backing allocation, layer-outermost (each layer's blocks contiguous).
        tensors = [
            KVCacheTensor(
                size=size * len(layers),
                layers=list(layers),
                layer_stride=size,
                block_stride=spec.page_size_bytes,
            )
        ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )


class _FlashLikeBackend:
    """Says the KV tensor is (K/V, num_blocks, block_size, heads, head_size), FlashAttention's."""

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, **_: Any
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)


class _Layer:
    def get_attn_backend(self) -> type[_FlashLikeBackend]:
        return _FlashLikeBackend


@contextmanager
def _attention_layers(names: list[str]) -> Iterator[None]:
    def layers(_config: Any, _layer_type: Any, layer_names: Any = None) -> dict[str, _Layer]:
        return {name: _Layer() for name in (layer_names or names)}

    if not HANDLERS_API:
        yield
        return
    with patch(f"{WORKER_MODULE}.get_layers_from_vllm_config", side_effect=layers):
        yield


def slot_bytes(position: int, token: int, nbytes: int) -> torch.Tensor:
    """The KV bytes of one token slot of one layer (K and V), fixed by position and token."""
    seed = int.from_bytes(hashlib.blake2b(f"{position}:{token}".encode(), digest_size=8).digest())
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


class Engine:
    """One scheduler, one worker connector, CPU "GPU" KV tensors for ``layers``."""

    def __init__(
        self,
        extra_config: dict[str, Any],
        *,
        layers: tuple[str, ...] = ("layer.0", "layer.1"),
        num_gpu_blocks: int = 64,
        block_size: int = 16,
        kv_events: bool = False,
    ) -> None:
        self.block_size = block_size
        self.layers = list(layers)
        self.config = vllm_config(
            {**SPEC, **extra_config}, block_size=block_size, kv_events=kv_events
        )
        self.config.cache_config.num_gpu_blocks = num_gpu_blocks
        self.kv_config = kv_cache_config(self.layers, num_gpu_blocks, block_size)
        with set_current_vllm_config(self.config):
            self.scheduler = Scheduler(
                vllm_config=self.config,
                kv_cache_config=self.kv_config,
                structured_output_manager=StructuredOutputManager(self.config),
                block_size=block_size,
                log_stats=True,
            )
            self.worker = OffloadingConnector(self.config, KVConnectorRole.WORKER, self.kv_config)
            shape = (2, num_gpu_blocks, block_size, NUM_KV_HEADS, HEAD_SIZE)
            if HANDLERS_API:
                self.kv = {name: torch.zeros(*shape, dtype=DTYPE) for name in self.layers}
            else:
                shape = (num_gpu_blocks, 2, block_size, NUM_KV_HEADS, HEAD_SIZE)
                backing = torch.zeros(len(self.layers), *shape, dtype=DTYPE)
                self.kv = dict(zip(self.layers, backing.unbind(0), strict=True))
            with _attention_layers(self.layers):
                self.worker.register_kv_caches(self.kv)
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(block_size, sha256)
        self._next_id = 0
        self.prompts: dict[str, list[int]] = {}

    @property
    def connector_scheduler(self) -> Any:
        return self.scheduler.connector.connector_scheduler

    def add_request(
        self,
        prompt: list[int],
        max_tokens: int = 2,
        kv_transfer_params: dict[str, Any] | None = None,
        kv_hints: Any = None,
    ) -> str:
        """Queue a request; ``kv_transfer_params`` travel as vLLM's OpenAI server passes a
        request body's field of that name (``SamplingParams.extra_args``); ``kv_hints`` (vLLM
        0.33+) as ``AsyncLLM`` passes an orchestrator's envelope."""
        req_id = f"req-{self._next_id}"
        self._next_id += 1
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        request = Request(
            request_id=req_id,
            prompt_token_ids=prompt,
            sampling_params=params,
            pooling_params=None,
            block_hasher=self._hasher,
            **({"kv_hints": kv_hints} if kv_hints is not None else {}),
        )
        self.prompts[req_id] = prompt
        self.scheduler.add_request(request)
        return req_id

    def _slot_nbytes(self) -> int:
        return NUM_KV_HEADS * HEAD_SIZE * DTYPE.itemsize

    def _compute(self, req_id: str, start: int, count: int) -> None:
        """Write the KV of tokens [start, start + count) of a request, as a model would."""
        request = self.scheduler.requests[req_id]
        tokens = request.all_token_ids
        (block_ids,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        nbytes = self._slot_nbytes()
        for pos in range(start, start + count):
            block, offset = block_ids[pos // self.block_size], pos % self.block_size
            for li, name in enumerate(self.layers):
                data = slot_bytes(pos * 131 + li, tokens[pos], 2 * nbytes).view(2, nbytes)
                self._block(name, block)[:, offset].reshape(2, -1).view(torch.uint8)[:] = data

    def expected_block(self, tokens: list[int], index: int) -> dict[str, torch.Tensor]:
        nbytes = self._slot_nbytes()
        out = {}
        for li, name in enumerate(self.layers):
            rows = []
            for pos in range(index * self.block_size, (index + 1) * self.block_size):
                rows.append(slot_bytes(pos * 131 + li, tokens[pos], 2 * nbytes).view(2, nbytes))
            out[name] = torch.stack(rows, dim=1)
        return out

    def block_bytes(self, block_id: int) -> dict[str, torch.Tensor]:
        return {
            name: self._block(name, block_id).reshape(2, self.block_size, -1).view(torch.uint8)
            for name in self.layers
        }

    def _block(self, name: str, block_id: int) -> torch.Tensor:
        """One GPU block of one layer as (K/V, block_size, heads, head_size)."""
        kv = self.kv[name]
        return kv[:, block_id] if HANDLERS_API else kv[block_id]

    def step(self) -> Any:
        """One engine step: schedule, run the worker connector and the "model", update."""
        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        worker = self.worker
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        for req_id, count in output.num_scheduled_tokens.items():
            # schedule() already advanced num_computed_tokens past this step's tokens.
            done = self.scheduler.requests[req_id].num_computed_tokens
            self._compute(req_id, done - count, count)
        if output.total_num_scheduled_tokens > 0:
            worker.wait_for_save()
        sending, recving = worker.get_finished(output.finished_req_ids)
        worker_meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        running = [r for r in self.scheduler.running if r.request_id in output.num_scheduled_tokens]
        req_ids = [r.request_id for r in running]
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=[[7] for _ in req_ids],
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending or None,
                finished_recving=recving or None,
                kv_connector_worker_meta=worker_meta,
            ),
        )
        self.scheduler.update_from_output(output, runner_output)
        return output

    def idle(self) -> bool:
        return not self.scheduler.requests and not self.connector_scheduler._jobs

    def run_until_idle(self, max_steps: int = 200) -> list[Any]:
        outputs = []
        for _ in range(max_steps):
            if self.idle():
                return outputs
            outputs.append(self.step())
            self.wait_transfers()
        raise AssertionError(f"the engine did not go idle in {max_steps} steps")

    def signal_finished(self) -> None:
        """One more step when requests finished since the last one: a live engine steps on,
        and its next schedule tells the connector (and, from vLLM 0.33, the manager) which
        requests finished; :meth:`run_until_idle` stops before that step."""
        if self.scheduler.finished_req_ids:
            self.step()
            self.wait_transfers()

    def wait_transfers(self) -> None:
        """Block until the worker's in-flight jobs finished (the CPU backend copies on threads)."""
        self.worker.connector_worker.worker.wait(set(self.connector_scheduler._jobs))

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()
