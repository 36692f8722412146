"""vLLM's manager calls answered by our manager, for every supported vLLM API generation.

Both generations ask the same of a manager (prepare/complete load and store, touch, reset,
shutdown) with vLLM's own result classes; they differ in ``lookup`` (a bool, later an enum)
and in the event's medium type, which each API module adds on top of this mixin.
Import only where vLLM is installed.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import LoadStoreSpec, PrepareStoreOutput
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvcache_offload import base as ours

__all__ = ["ManagerBridge"]


class ManagerBridge:
    """The calls that are the same in every vLLM API generation (mixed in before vLLM's ABC)."""

    def __init__(self, manager: ours.OffloadingManager) -> None:
        self._manager = manager

    def prepare_load(self, keys: Any, req_context: Any) -> LoadStoreSpec:
        spec = self._manager.prepare_load(list(keys), req_context)
        return CPULoadStoreSpec(_block_ids(spec))

    def touch(self, keys: Any, req_context: Any) -> None:
        self._manager.touch(list(keys), req_context)

    def complete_load(self, keys: Any, req_context: Any) -> None:
        self._manager.complete_load(list(keys), req_context)

    def prepare_store(self, keys: Any, req_context: Any) -> PrepareStoreOutput | None:
        output = self._manager.prepare_store(list(keys), req_context)
        if output is None:
            return None
        return PrepareStoreOutput(
            keys_to_store=output.keys_to_store,
            store_spec=CPULoadStoreSpec(_block_ids(output.store_spec)),
            evicted_keys=output.evicted_keys,
        )

    def complete_store(self, keys: Any, req_context: Any, success: bool = True) -> None:
        self._manager.complete_store(list(keys), req_context, success)

    def reset_cache(self) -> None:
        self._manager.reset_cache()

    def shutdown(self) -> None:
        self._manager.shutdown()


def _block_ids(spec: ours.LoadStoreSpec) -> Any:
    return spec.block_ids  # type: ignore[attr-defined]
