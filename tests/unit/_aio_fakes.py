"""A controllable in-memory handler and spec for testing the async core without a data plane."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

from kvcache_offload import CPULoadStoreSpec, GPULoadStoreSpec, KVCacheLayout, OffloadConfig
from kvcache_offload.contracts.handler import (
    OffloadingHandler,
    TransferResult,
    TransferSpec,
)
from kvcache_offload.contracts.kv_caches import CanonicalKVCaches
from kvcache_offload.contracts.load_store_spec import LoadStoreSpec
from kvcache_offload.dataplane.memory.block_memory import HostBlockMemory
from kvcache_offload.dataplane.spec import CPUOffloadingSpec

BLOCK_BYTES = 64


class FakeHandler(OffloadingHandler):
    """Jobs finish when the test says so (or at once with ``auto=True``), in submission order."""

    def __init__(self, auto: bool = True) -> None:
        self.auto = auto
        self.submitted: list[tuple[int, TransferSpec]] = []
        self.pending: list[int] = []
        self.released: set[int] = set()
        self.fail_ids: set[int] = set()
        self.refuse = False
        self.fail_all = False
        self.fail_next = 0
        """How many of the next submitted jobs fail."""
        self.shutdown_called = False
        self._lock = threading.Lock()

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        if self.refuse:
            return False
        with self._lock:
            if self.fail_next > 0:
                self.fail_next -= 1
                self.fail_ids.add(job_id)
            self.submitted.append((job_id, spec))
            self.pending.append(job_id)
        return True

    def release(self, job_id: int | None = None) -> None:
        with self._lock:
            if job_id is None:
                self.released.update(self.pending)
            else:
                self.released.add(job_id)

    def get_finished(self) -> list[TransferResult]:
        out = []
        with self._lock:
            while self.pending and (self.auto or self.pending[0] in self.released):
                job_id = self.pending.pop(0)
                ok = not (self.fail_all or job_id in self.fail_ids)
                src, dst = next(s for j, s in self.submitted if j == job_id)
                n = len(getattr(dst, "block_ids", ()))
                out.append(
                    TransferResult(job_id, ok, n * BLOCK_BYTES, 1e-4, (src.medium(), dst.medium()))
                )
        return out

    def wait(self, job_ids: set[int]) -> None:
        self.release()

    def shutdown(self) -> None:
        self.shutdown_called = True


class FakeSpec(CPUOffloadingSpec):
    """CPU manager plus one FakeHandler for both directions and a host block memory."""

    def __init__(self, config: OffloadConfig, handler: FakeHandler | None = None) -> None:
        super().__init__(config, config.layout)
        self.handler = handler or FakeHandler()
        self.memory: HostBlockMemory | None = None

    def get_handlers(
        self, kv_caches: CanonicalKVCaches
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        yield GPULoadStoreSpec, CPULoadStoreSpec, self.handler
        yield CPULoadStoreSpec, GPULoadStoreSpec, self.handler

    def get_block_memory(self) -> HostBlockMemory:
        if self.memory is None:
            self.memory = HostBlockMemory(self.num_blocks, BLOCK_BYTES)
        return self.memory


def small_config(num_blocks: int = 8, **overrides: Any) -> OffloadConfig:
    layout = KVCacheLayout(gpu_block_sizes=[16], bytes_per_block=BLOCK_BYTES, num_gpu_blocks=64)
    return OffloadConfig(cpu_bytes_to_use=num_blocks * BLOCK_BYTES, layout=layout, **overrides)


NO_KV = CanonicalKVCaches(tensors=[])


async def wait_for(predicate: Any, timeout: float = 5.0) -> None:
    """Poll a condition on the loop until true; fail after ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.001)
