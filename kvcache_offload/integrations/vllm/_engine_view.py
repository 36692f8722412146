"""A read-only engine over vLLM's manager, shaped as the service's routes expect an engine.

The service's routes serve an ``OffloadEngine`` on an event loop. Inside vLLM there is no such
engine: the manager lives on vLLM's scheduler thread, behind an :class:`ObservedManager`.
:class:`EngineView` answers the routes' reads (``stats``, ``lookup``, ``subscribe``) from that
manager and owns the event hub the SSE route reads. The hub belongs to the side port's loop:
vLLM's thread hands events over with :meth:`publish_threadsafe` (queued, then published by one
callback on the loop per batch). Every call that would change the tier raises
:class:`ReadOnlyError`: vLLM's scheduler alone decides what is stored and loaded.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Collection, Sequence
from typing import Any

from kvcache_offload.aio.engine_stats import tier_counts
from kvcache_offload.aio.types import (
    EngineStats,
    EventType,
    KeyState,
    LookupResult,
)
from kvcache_offload.config import OffloadConfig
from kvcache_offload.contracts.manager import ReqContext
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import OffloadError
from kvcache_offload.events.hub import EventHub, EventSubscription
from kvcache_offload.integrations.vllm._observed_manager import ObservedManager

__all__ = ["EngineView", "ReadOnlyError"]

_STATE = {True: KeyState.READY, None: KeyState.WRITING, False: KeyState.ABSENT}


class ReadOnlyError(OffloadError):
    """The side port only reads: vLLM's scheduler owns every store, load and reset."""


class EngineView:
    """The reads of ``OffloadEngine`` over an observed vLLM manager (see the module docstring)."""

    def __init__(self, config: OffloadConfig, block_nbytes: int) -> None:
        self.config = config
        self._block_nbytes = block_nbytes
        self._observed: ObservedManager | None = None
        self._hub = EventHub(config.event_buffer_size, config.subscriber_queue_size)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: deque[tuple[EventType, list[OffloadKey], str, dict[str, Any]]] = deque(
            maxlen=config.event_buffer_size
        )
        self._pending_lock = threading.Lock()
        self._drain_scheduled = False
        self.closed = False

    def observe(self, observed: ObservedManager) -> None:
        self._observed = observed

    # -- the loop that serves the view --------------------------------------------------------

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Publish on ``loop`` from now on (called on that loop's thread)."""
        with self._pending_lock:
            self._loop = loop
            self._schedule_drain()

    def close(self) -> None:
        """End every event stream (on the loop's thread); later events are dropped."""
        with self._pending_lock:
            self._loop = None
            self._pending.clear()
        self.closed = True
        self._hub.close()

    # -- vLLM's thread ------------------------------------------------------------------------

    def publish_threadsafe(
        self, type: EventType, keys: list[OffloadKey], medium: str, detail: dict[str, Any]
    ) -> None:
        """Queue one event for the hub; one loop callback publishes everything queued."""
        with self._pending_lock:
            if self.closed:
                return
            self._pending.append((type, keys, medium, detail))
            self._schedule_drain()

    def _schedule_drain(self) -> None:
        if self._drain_scheduled or self._loop is None or not self._pending:
            return
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop closed under us: nobody reads events any more
            self._loop = None
            return
        self._drain_scheduled = True

    def _drain(self) -> None:
        with self._pending_lock:
            items = list(self._pending)
            self._pending.clear()
            self._drain_scheduled = False
        for kind, keys, medium, detail in items:
            self._hub.publish(kind, keys, medium=medium, detail=detail)

    # -- what the routes read (loop thread) ---------------------------------------------------

    @property
    def block_nbytes(self) -> int:
        return self._block_nbytes

    @property
    def event_hub(self) -> EventHub:
        return self._hub

    def stats(self) -> EngineStats:
        if self._observed is None:
            raise ReadOnlyError("vLLM has not created its offloading manager yet")
        counters, snap, skipped = self._observed.snapshot()
        hub = self._hub
        return EngineStats(
            **tier_counts(snap, self.config.eviction_policy),
            block_nbytes=self._block_nbytes,
            **vars(counters),
            reuse_filter_skipped_blocks=skipped,
            event_subscribers=hub.subscribers,
            events_published=hub.published,
            events_dropped=hub.dropped,
            last_event_seq=hub.last_seq,
        )

    async def lookup(
        self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None
    ) -> LookupResult:
        """Each key's state and the ready prefix, as vLLM's scheduler would see them now.

        Not counted in the lookup metrics, which describe vLLM's own lookups.
        """
        if self._observed is None:
            raise ReadOnlyError("vLLM has not created its offloading manager yet")
        answers = self._observed.peek(keys)
        n = len(answers)
        first_absent = answers.index(False) if False in answers else n
        first_writing = answers.index(None) if None in answers else n
        return LookupResult(
            hits=min(first_absent, first_writing),
            pending=first_writing < first_absent,
            states=[_STATE[a] for a in answers],
        )

    def subscribe(
        self,
        types: Collection[EventType] | None = None,
        since_seq: int | None = None,
        queue_size: int | None = None,
    ) -> EventSubscription:
        return self._hub.subscribe(types, since_seq=since_seq, queue_size=queue_size)

    def region_info(self) -> dict[str, Any] | None:
        """None: a shared region belongs to vLLM's worker processes, not to the scheduler's."""
        return None

    async def aclose(self) -> None:
        self.close()

    # -- refused: vLLM's scheduler owns the tier ----------------------------------------------

    def __getattr__(self, name: str) -> Any:
        """The engine's calls that change the tier exist here only to refuse: awaiting one
        raises :class:`ReadOnlyError` (the side port's gate already answers their routes 404)."""
        if name not in _REFUSED:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

        async def refuse(*_args: object, **_kwargs: object) -> Any:
            raise _read_only(name)

        return refuse


_REFUSED = frozenset(
    {
        "touch", "prepare_store", "complete_store", "prepare_load", "complete_load",
        "write_blocks", "read_block", "reset",
    }
)  # fmt: skip


def _read_only(call: str) -> ReadOnlyError:
    return ReadOnlyError(
        f"{call} is not served inside vLLM: the side port is read-only (vLLM's scheduler "
        "decides every store, load and reset)"
    )
