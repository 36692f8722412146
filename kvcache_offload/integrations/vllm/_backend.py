"""This library's CPU tier behind a vLLM spec: manager, handlers for vLLM's KV tensors, clean-up.

vLLM calls ``shutdown`` on handlers and managers but never on a spec, so the spec's resources
(handler threads, pinned buffers, a shared ``/dev/shm`` region) are released by a finalizer
that runs at the latest when the process exits.

With a side port configured, the manager vLLM gets is an :class:`ObservedManager` read by an
:class:`EngineView` that the side port serves; finished transfers of a worker in the same
process are counted on it too (found by vLLM's engine id). The side port lives as long as that
manager, not as the spec: vLLM's scheduler keeps the manager and drops the spec. It stops when
vLLM shuts the manager down, when the spec is shut down, or at the latest at process exit.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

from kvcache_offload.config import OffloadConfig
from kvcache_offload.contracts.handler import OffloadingHandler, TransferResult
from kvcache_offload.contracts.manager import OffloadingManager
from kvcache_offload.dataplane.spec import CPUOffloadingSpec
from kvcache_offload.integrations.vllm._observed_manager import (
    LOAD_DIRECTION,
    STORE_DIRECTION,
    ObservedManager,
    observed_for,
)
from kvcache_offload.integrations.vllm._settings import SidePortSettings
from kvcache_offload.integrations.vllm._translate import canonical_kv_caches

__all__ = ["OffloadBackend"]

_DIRECTIONS = {("GPU", "CPU"): STORE_DIRECTION, ("CPU", "GPU"): LOAD_DIRECTION}


class OffloadBackend:
    def __init__(
        self,
        config: OffloadConfig,
        *,
        side_port: SidePortSettings | None = None,
        vllm_events: bool | None = None,
        engine_id: str | None = None,
    ) -> None:
        """``vllm_events``: whether vLLM drains the manager's events (default: if it keeps them)."""
        self.config = config
        self.spec = CPUOffloadingSpec(config, config.layout)
        self.engine_id = engine_id
        self._side_port_settings = side_port
        self._vllm_events = config.enable_events if vllm_events is None else vllm_events
        self._manager: OffloadingManager | None = None
        self._handlers: tuple[OffloadingHandler, OffloadingHandler] | None = None
        self._side_ports: list[Any] = []
        self._finalizer = weakref.finalize(self, self.spec.shutdown)

    @property
    def num_blocks(self) -> int:
        return self.spec.num_blocks

    @property
    def side_port(self) -> Any:
        """The running side port (``integrations/vllm/_side_port.py``), or None."""
        return self._side_ports[0] if self._side_ports else None

    def manager(self) -> OffloadingManager:
        """Our manager (built once); observed and served on the side port when configured."""
        if self._manager is None:
            manager = self.spec.get_manager()
            if self._side_port_settings is not None:
                manager = self._observed(manager, self._side_port_settings)
            self._manager = manager
        return self._manager

    def _observed(self, manager: OffloadingManager, where: SidePortSettings) -> ObservedManager:
        from kvcache_offload.integrations.vllm._engine_view import EngineView
        from kvcache_offload.integrations.vllm._side_port import start_side_port

        view = EngineView(self.config, int(self.spec.kv_bytes_per_offloaded_block))
        ports = self._side_ports
        observed = ObservedManager(
            manager,
            view.publish_threadsafe,
            forward_events=self._vllm_events,
            engine_id=self.engine_id,
            on_shutdown=lambda: _stop(ports),
        )
        view.observe(observed)
        ports.append(start_side_port(view, where.host, where.port))
        weakref.finalize(observed, _stop, ports)
        return observed

    def handlers(
        self, vllm_kv_caches: Any, rank: int | None = None
    ) -> tuple[OffloadingHandler, OffloadingHandler]:
        """(store handler, load handler) over vLLM's canonical KV caches (built once).

        ``rank`` is this worker's cell in a shared region (needed with several workers).
        """
        if self._handlers is not None:
            return self._handlers
        by_direction = {
            (src.medium(), dst.medium()): handler
            for src, dst, handler in self.spec.get_handlers(
                canonical_kv_caches(vllm_kv_caches), rank=rank
            )
        }
        self._handlers = by_direction[("GPU", "CPU")], by_direction[("CPU", "GPU")]
        return self._handlers

    def count_finished(self, direction: str, results: Iterable[TransferResult]) -> None:
        """Count finished copies on this process's side port, when it has one.

        ``direction`` names the handler's; a result that says its own transfer type wins.
        """
        observed = observed_for(self.engine_id)
        if observed is None:
            return
        for result in results:
            if result.success:
                kind = _DIRECTIONS.get(result.transfer_type or ("", ""), direction)
                observed.record_transfer(kind, result.transfer_size, result.transfer_time)

    def shutdown(self) -> None:
        """Stop the side port and handlers, release memory and the region; idempotent."""
        _stop(self._side_ports)
        self._finalizer()


def _stop(side_ports: list[Any]) -> None:
    while side_ports:
        side_ports.pop().stop()
