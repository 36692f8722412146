"""vLLM's manager calls answered by our manager, for every supported vLLM API generation.

Both generations ask the same of a manager (prepare/complete load and store, touch, reset,
shutdown) with vLLM's own result classes; they differ in ``lookup`` (a bool, later an enum)
and in the event's medium type, which each API module adds on top of this mixin.
Import only where vLLM is installed.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.kv_offload.base import LoadStoreSpec, PrepareStoreOutput
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvcache_offload import contracts as ours
from kvcache_offload.contracts.capabilities import DiscardsBlocks
from kvcache_offload.integrations.vllm._hints import session_ends

__all__ = ["ManagerBridge"]

logger = logging.getLogger(__name__)


class ManagerBridge:
    """The calls that are the same in every vLLM API generation (mixed in before vLLM's ABC)."""

    def __init__(self, manager: ours.OffloadingManager) -> None:
        self._manager = manager
        hints = manager if isinstance(manager, DiscardsBlocks) else None
        self._hints: DiscardsBlocks | None = hints
        self._hint_refused = False

    def _session_ended(self, keys: list[Any], req_context: Any) -> None:
        """Release ``keys`` if their request said its session ends (see ``_hints``)."""
        if not session_ends(req_context):
            return
        if self._hints is not None:
            self._hints.release(keys)
        elif not self._hint_refused:
            self._hint_refused = True
            logger.warning(
                "%s cannot release blocks: session-end hints are ignored",
                type(self._manager).__name__,
            )

    def prepare_load(self, keys: Any, req_context: Any) -> LoadStoreSpec:
        spec = self._manager.prepare_load(list(keys), req_context)
        return CPULoadStoreSpec(_block_ids(spec))

    def touch(self, keys: Any, req_context: Any) -> None:
        keys = list(keys)
        self._manager.touch(keys, req_context)
        self._session_ended(keys, req_context)

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
        keys = list(keys)
        self._manager.complete_store(keys, req_context, success)
        if success:
            self._session_ended(keys, req_context)

    def reset_cache(self) -> None:
        self._manager.reset_cache()

    def shutdown(self) -> None:
        self._manager.shutdown()


def _block_ids(spec: ours.LoadStoreSpec) -> Any:
    return spec.block_ids  # type: ignore[attr-defined]
