"""Our manager as vLLM's scheduler drives it, watched from another thread.

vLLM calls its offloading manager on the scheduler thread; the side port (``_side_port.py``)
reads the same manager from its own thread. :class:`ObservedManager` sits between vLLM's
adapter and our manager: every call holds one lock, so a reader sees the manager between two
vLLM calls, never inside one. It also keeps the counters the service exports (lookups, hits,
stores prepared and rejected, bytes moved) and hands each offloading event to a sink, which
publishes it on the side port's event loop.

The manager keeps events whenever the side port is on. vLLM drains them (``take_events``) only
when its own KV events are on, so they are passed on to vLLM only then and never pile up.

Worker-side transfer results reach the counters through :func:`observed_for` when the worker
shares the scheduler's process (a single-GPU vLLM); each engine registers itself by id.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvcache_offload.aio.engine_core import LOAD_DIRECTION, STORE_DIRECTION, EngineTotals
from kvcache_offload.aio.types import EventType, Histogram
from kvcache_offload.contracts.capabilities import DiscardsBlocks, ReportsStats, SkipsStores
from kvcache_offload.contracts.load_store_spec import LoadStoreSpec
from kvcache_offload.contracts.manager import (
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
)
from kvcache_offload.contracts.offload_key import OffloadKey

__all__ = [
    "LOAD_DIRECTION",
    "STORE_DIRECTION",
    "EventSink",
    "ObservedCounters",
    "ObservedManager",
    "observed_for",
]

EventSink = Callable[[EventType, list[OffloadKey], str, dict[str, Any]], None]
"""Called on vLLM's thread with (type, keys, medium, detail) for each offloading event."""

_BY_ENGINE: weakref.WeakValueDictionary[str, ObservedManager] = weakref.WeakValueDictionary()


def observed_for(engine_id: str | None) -> ObservedManager | None:
    """The observed manager of this process's vLLM engine ``engine_id``, if it has a side port."""
    return _BY_ENGINE.get(engine_id) if engine_id is not None else None


class ObservedCounters(EngineTotals):
    """What the service's engine counts itself (its :class:`EngineTotals`, by the same names),
    counted here for vLLM's calls, plus the transfers of a worker in this process. vLLM asks
    one key per lookup call, so ``lookup_keys`` equals ``lookups``."""

    def __init__(self) -> None:
        super().__init__()
        self.transfer_bytes = {STORE_DIRECTION: 0, LOAD_DIRECTION: 0}
        self.transfer_seconds = {STORE_DIRECTION: 0.0, LOAD_DIRECTION: 0.0}
        self.transfer_duration = {STORE_DIRECTION: Histogram(), LOAD_DIRECTION: Histogram()}

    def copy(self) -> ObservedCounters:
        twin = copy.copy(self)
        twin.transfer_bytes = dict(self.transfer_bytes)
        twin.transfer_seconds = dict(self.transfer_seconds)
        twin.transfer_duration = {
            d: Histogram(h.bounds, list(h.counts), h.sum, h.count)
            for d, h in self.transfer_duration.items()
        }
        return twin


class ObservedManager(OffloadingManager):
    """``manager`` behind a lock, counted, its events sent to ``sink`` (and to vLLM if asked)."""

    def __init__(
        self,
        manager: OffloadingManager,
        sink: EventSink,
        *,
        forward_events: bool,
        engine_id: str | None = None,
        on_shutdown: Callable[[], None] | None = None,
    ) -> None:
        self.manager = manager
        self.lock = threading.Lock()
        self._sink = sink
        self._forward: list[OffloadingEvent] | None = [] if forward_events else None
        self._counters = ObservedCounters()
        self._on_shutdown = on_shutdown
        if engine_id is not None:
            _BY_ENGINE[engine_id] = self

    # -- what a reader on another thread sees -------------------------------------------------

    def snapshot(self) -> tuple[ObservedCounters, Any, int]:
        """(counters, the manager's stats or None, blocks the reuse filter skipped), at once."""
        with self.lock:
            stats = self.manager.stats() if isinstance(self.manager, ReportsStats) else None
            skipped = self.manager.stores_skipped if isinstance(self.manager, SkipsStores) else 0
            return self._counters.copy(), stats, int(skipped)

    def peek(self, keys: Sequence[OffloadKey]) -> list[bool | None]:
        """The manager's answer per key (ready, being written, absent), counted nowhere."""
        context = ReqContext()
        with self.lock:
            return [self.manager.lookup(key, context) for key in keys]

    def record_transfer(self, direction: str, nbytes: int | None, seconds: float | None) -> None:
        """A finished copy (called from the worker's thread when it shares this process)."""
        with self.lock:
            c = self._counters
            c.transfer_bytes[direction] = c.transfer_bytes.get(direction, 0) + (nbytes or 0)
            if seconds is not None:
                c.transfer_seconds[direction] = c.transfer_seconds.get(direction, 0.0) + seconds
                c.transfer_duration.setdefault(direction, Histogram()).observe(seconds)

    # -- vLLM's calls -------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        with self.lock:
            found = self.manager.lookup(key, req_context)
            self._counters.lookups += 1
            self._counters.lookup_keys += 1
            self._counters.lookup_hit_blocks += found is True
        return found

    def prepare_load(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        with self.lock:
            return self.manager.prepare_load(keys, req_context)

    def touch(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> None:
        with self.lock:
            self.manager.touch(keys, req_context)

    def release(self, keys: Sequence[OffloadKey]) -> int:
        """The manager's ``release`` (a session-end hint), under the lock; 0 where the
        manager takes no hints."""
        with self.lock:
            if not isinstance(self.manager, DiscardsBlocks):
                return 0
            return self.manager.release(keys)

    def complete_load(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> None:
        with self.lock:
            self.manager.complete_load(keys, req_context)
            self._counters.load_blocks_completed += len(keys)
        if keys:
            self._sink(
                EventType.LOAD_COMPLETED, list(keys), "CPU", {"req_id": _req_id(req_context)}
            )

    def prepare_store(
        self, keys: Sequence[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        with self.lock:
            output = self.manager.prepare_store(keys, req_context)
            if output is None:
                self._counters.stores_rejected += 1
            else:
                self._counters.store_blocks_prepared += len(output.keys_to_store)
                self._counters.evicted_blocks += len(output.evicted_keys)
            events = self._drain_manager_events()
        self._publish(events)
        return output

    def complete_store(
        self, keys: Sequence[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        with self.lock:
            self.manager.complete_store(keys, req_context, success)
            if success:
                self._counters.store_blocks_completed += len(keys)
            else:
                self._counters.store_blocks_failed += len(keys)
            events = self._drain_manager_events()
        self._publish(events)
        if not success and keys:
            detail = {"req_id": _req_id(req_context), "reason": "transfer failed"}
            self._sink(EventType.STORE_FAILED, list(keys), "CPU", detail)

    def take_events(self) -> Iterable[OffloadingEvent]:
        forwarded: list[OffloadingEvent] = []
        with self.lock:
            events = self._drain_manager_events()
            if self._forward is not None:
                forwarded, self._forward = self._forward, []
        self._publish(events)
        return forwarded

    def reset_cache(self) -> None:
        with self.lock:
            self.manager.reset_cache()
            events = self._drain_manager_events()
        self._publish(events)
        self._sink(EventType.RESET, [], "CPU", {})

    def shutdown(self) -> None:
        with self.lock:
            self.manager.shutdown()
        if self._on_shutdown is not None:
            self._on_shutdown()

    # -- events -------------------------------------------------------------------------------

    def _drain_manager_events(self) -> list[OffloadingEvent]:
        """The manager's new events (lock held); kept for vLLM when it drains them."""
        events = list(self.manager.take_events())
        if self._forward is not None:
            self._forward.extend(events)
        return events

    def _publish(self, events: list[OffloadingEvent]) -> None:
        for event in events:
            kind = EventType.EVICTED if event.removed else EventType.STORED
            self._sink(kind, list(event.keys), event.medium, {})

    def __getattr__(self, name: str) -> Any:
        """Anything else a caller asks of our manager (``stats``, ``policy``, ...)."""
        if name == "manager":  # not yet set: never recurse
            raise AttributeError(name)
        return getattr(self.manager, name)


def _req_id(req_context: Any) -> str:
    """The request id, where the context has one (vLLM 0.21's has none)."""
    return str(getattr(req_context, "req_id", "") or "")
