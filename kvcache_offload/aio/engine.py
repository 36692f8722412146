"""OffloadEngine: the asyncio facade over one spec's manager, worker, event hub and leases.

Every manager and policy call runs on the event-loop thread, so the control plane needs no
locks; only copies (worker threads or CUDA streams) and block-memory reads/writes run
elsewhere. The engine is composed of the parts it holds, each in its own module, all over
one :class:`~kvcache_offload.aio.engine_core.EngineCore` (the shared state and the manager
steps every operation takes):

* ``aio/engine_lookups.py``: ``lookup``/``lookup_now``/``touch``/``discard``/``release``;
* ``aio/engine_jobs.py``: the one-shot ``store``/``load`` jobs;
* ``aio/engine_leases.py``: the two-step operations of sidecar clients and lease expiry;
* ``aio/engine_block_bytes.py``: ``write_blocks``/``read_block`` for remote clients;
* ``aio/engine_lifecycle.py``: ``start``, ``reset``, ``aclose``;
* ``aio/engine_core.py``: the state and steps they share, and the background runner;
* ``aio/engine_build.py``: the worker, KV-event publisher and tiers built from the config.

The engine's methods are its parts' methods: ``store``, ``load``, ``lookup`` and
``lookup_now`` are the parts' bound methods themselves on each engine (no forwarding call on
the hot path); the others forward. Pins never outlive an operation: open leases roll back
on expiry, :meth:`OffloadEngine.reset` and :meth:`OffloadEngine.aclose`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Concatenate, Generic, ParamSpec, Self, TypeVar, overload

from kvcache_offload.aio.engine_block_bytes import BlockBytes
from kvcache_offload.aio.engine_build import build_tiers
from kvcache_offload.aio.engine_core import EngineCore
from kvcache_offload.aio.engine_jobs import TransferJobs
from kvcache_offload.aio.engine_leases import LeaseOperations
from kvcache_offload.aio.engine_lifecycle import Lifecycle
from kvcache_offload.aio.engine_lookups import Lookups
from kvcache_offload.aio.engine_stats import collect_stats
from kvcache_offload.aio.layerwise import LayerwiseLoad, LayerwiseLoads
from kvcache_offload.aio.types import EngineStats
from kvcache_offload.config import OffloadConfig
from kvcache_offload.events.hub import EventHub

if TYPE_CHECKING:
    from kvcache_offload.aio.engine_jobs import GpuBlocks
    from kvcache_offload.aio.gc_freeze import HeapFreeze
    from kvcache_offload.aio.poller import TransferPoller
    from kvcache_offload.aio.tiering import EngineTiers
    from kvcache_offload.contracts.kv_caches import CanonicalKVCaches
    from kvcache_offload.contracts.manager import OffloadingManager, ReqContext
    from kvcache_offload.contracts.offload_key import OffloadKey
    from kvcache_offload.contracts.spec import OffloadingSpec
    from kvcache_offload.dataplane.handlers.router import OffloadingWorker
    from kvcache_offload.dataplane.memory.block_memory import BlockMemory
    from kvcache_offload.kv_events.publisher import KVEventPublisher

__all__ = ["OffloadEngine"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_T = TypeVar("_T")


def _part_method(
    part: str, method: Callable[Concatenate[_T, _P], _R]
) -> Callable[Concatenate[OffloadEngine, _P], _R]:
    """An engine method that is one of its parts' (``part`` names the attribute holding
    it): one signature and docstring, kept by the part."""

    def forward(engine: OffloadEngine, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return method(getattr(engine, part), *args, **kwargs)

    forward.__name__, forward.__doc__ = method.__name__, method.__doc__
    forward.__wrapped__ = method  # type: ignore[attr-defined]  # inspect.signature shows the part's
    return forward


class _CoreView(Generic[_T]):
    """A read-only engine attribute that is its core's (``name`` there)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._attr = name

    def __set_name__(self, owner: type, attr: str) -> None:
        self._attr = attr

    @overload
    def __get__(self, engine: None, owner: type) -> Self: ...
    @overload
    def __get__(self, engine: OffloadEngine, owner: type) -> _T: ...
    def __get__(self, engine: OffloadEngine | None, owner: type) -> Self | _T:
        if engine is None:
            return self
        value: _T = getattr(engine._core, self._name)
        return value

    def __set__(self, engine: OffloadEngine, value: object) -> None:
        raise AttributeError(f"the engine's {self._attr!r} is read-only")


class OffloadEngine:
    """Async offloading engine; see the module docstring for the semantics.

    ``access_observers`` receive the access stream (``on_lookup(keys, hits)``,
    ``on_store(keys)``) and may provide ``mrc_stats(capacity_blocks)`` for :meth:`stats`;
    an observer that raises is logged and otherwise ignored.
    """

    def __init__(
        self,
        config: OffloadConfig | None = None,
        *,
        kv_caches: CanonicalKVCaches | None = None,
        spec: OffloadingSpec | None = None,
        access_observers: Sequence[object] = (),
        poll_spin_s: float = 0.02,
        poll_backoff_s: float = 0.001,
        close_timeout_s: float = 30.0,
        observer_budget: float | None = None,
    ) -> None:
        core = EngineCore(
            config,
            kv_caches=kv_caches,
            spec=spec,
            access_observers=access_observers,
            poll_spin_s=poll_spin_s,
            poll_backoff_s=poll_backoff_s,
            close_timeout_s=close_timeout_s,
            observer_budget=observer_budget,
        )
        self._core = core
        self.config: OffloadConfig = core.config
        self.spec: OffloadingSpec = core.spec
        self.manager: OffloadingManager = core.manager
        self._blocks = BlockBytes(core)
        core._tiers = build_tiers(core, self._blocks)
        self._lookups = Lookups(core)
        self._jobs = TransferJobs(core)
        self._lease_ops = LeaseOperations(core)
        self._lifecycle = Lifecycle(core, self._blocks)
        self._layerwise = LayerwiseLoads(core)
        # The hot path: the parts' bound methods themselves (the class's forwarders below
        # keep the signatures and docs; an instance attribute wins over them).
        self.__dict__.update(
            store=self._jobs.store,
            load=self._jobs.load,
            lookup=self._lookups.lookup,
            lookup_now=self._lookups.lookup_now,
        )

    # -- the parts' operations -------------------------------------------------------------

    store = _part_method("_jobs", TransferJobs.store)
    load = _part_method("_jobs", TransferJobs.load)
    lookup = _part_method("_lookups", Lookups.lookup)
    lookup_now = _part_method("_lookups", Lookups.lookup_now)
    touch = _part_method("_lookups", Lookups.touch)
    discard = _part_method("_lookups", Lookups.discard)
    discard_now = _part_method("_lookups", Lookups.discard_now)
    release = _part_method("_lookups", Lookups.release)
    prepare_store = _part_method("_lease_ops", LeaseOperations.prepare_store)
    complete_store = _part_method("_lease_ops", LeaseOperations.complete_store)
    prepare_load = _part_method("_lease_ops", LeaseOperations.prepare_load)
    complete_load = _part_method("_lease_ops", LeaseOperations.complete_load)
    write_blocks = _part_method("_blocks", BlockBytes.write_blocks)
    read_block = _part_method("_blocks", BlockBytes.read_block)
    region_info = _part_method("_blocks", BlockBytes.region_info)
    start = _part_method("_lifecycle", Lifecycle.start)
    reset = _part_method("_lifecycle", Lifecycle.reset)

    async def load_layerwise(
        self,
        keys: Sequence[OffloadKey],
        gpu_blocks: GpuBlocks,
        req_context: ReqContext | None = None,
        *,
        refs_per_layer: int = 1,
    ) -> LayerwiseLoad:
        """``load``, issued layer by layer: returns once the copy is issued, with a handle
        whose ``wait_layer(i, stream)`` orders a stream after layer i's copy and whose
        ``done()`` gives the :class:`LoadResult` (``aio/layerwise.py``). A layer is
        ``refs_per_layer`` consecutive refs of the one KV-cache group (2 for separate K and
        V tensors)."""
        return await self._layerwise.load(keys, gpu_blocks, req_context, refs_per_layer)

    async def aclose(self) -> None:
        """Finish or fail in-flight jobs (layer-wise loads first), roll back leases, stop
        tasks, release everything. Idempotent and shielded from cancellation."""
        if not self._core._closed:
            await self._layerwise.drain(self._core.close_timeout_s)
        await self._lifecycle.aclose()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def block_nbytes(self) -> int:
        """Bytes of one offloaded block: the page size of ``write_blocks``/``read_block``."""
        return self._blocks.block_nbytes

    closed: _CoreView[bool] = _CoreView("_closed")
    close_timeout_s: _CoreView[float] = _CoreView("close_timeout_s")

    def stats(self) -> EngineStats:
        self._core._release_quarantined()
        return collect_stats(self._core)

    subscribe = _part_method("_hub", EventHub.subscribe)
    """An async iterator of events (and gap markers); ``since_seq`` resumes after it."""
    events = subscribe
    """Alias of :meth:`subscribe`."""

    event_hub: _CoreView[EventHub] = _CoreView("_hub")
    kv_events: _CoreView[KVEventPublisher | None] = _CoreView("_kv_events")
    """The ZMQ KV-event publisher, when ``kv_events_endpoint`` is configured."""
    worker: _CoreView[OffloadingWorker | None] = _CoreView("_worker")

    # -- the core's pieces, for the service's introspection and tests ----------------------

    _hub: _CoreView[EventHub] = _CoreView("_hub")
    _poller: _CoreView[TransferPoller | None] = _CoreView("_poller")
    _tiers: _CoreView[EngineTiers | None] = _CoreView("_tiers")
    _heap_freeze: _CoreView[HeapFreeze] = _CoreView("_heap_freeze")

    async def _get_block_memory(self) -> BlockMemory:
        return await self._blocks.get_block_memory()
