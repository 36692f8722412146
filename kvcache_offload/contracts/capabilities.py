"""Optional capabilities of specs, managers and access observers, declared, not probed.

The ABCs say what every spec, manager and handler must do. These Protocols say what some of
them can also do; the engine checks them once (``isinstance``, when it is built) and then
calls them directly, so a capability is a named contract rather than a ``getattr`` guess.
The handlers' own capabilities (:class:`~kvcache_offload.contracts.handler.NotifiesCompletion`,
:class:`~kvcache_offload.contracts.handler.BatchesJobs`) live with the handler contract.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from kvcache_offload.contracts.offload_key import OffloadKey

__all__ = [
    "CapacityObserver",
    "CountsFencedSlots",
    "DiscardsBlocks",
    "EvictsAhead",
    "FencesSlots",
    "HasBlockMemory",
    "LookupObserver",
    "ManagerSnapshot",
    "MissRatioReporter",
    "ReportsStats",
    "ShadowReporter",
    "ShadowSnapshot",
    "ShutsDown",
    "SizesCpuTier",
    "SizesOffloadedBlocks",
    "SkipsStores",
    "StoreObserver",
]


@runtime_checkable
class ShutsDown(Protocol):
    """A spec that holds resources (handlers, pinned memory, a shared region) to release."""

    def shutdown(self) -> None: ...


@runtime_checkable
class HasBlockMemory(Protocol):
    """A spec whose CPU tier can be read and written by block (remote clients, tiers)."""

    def get_block_memory(self) -> Any: ...


@runtime_checkable
class SizesOffloadedBlocks(Protocol):
    """A spec that knows the bytes of one offloaded block (``block_size_factor`` GPU blocks)."""

    kv_bytes_per_offloaded_block: int


@runtime_checkable
class SizesCpuTier(Protocol):
    """A spec that knows its CPU tier's size before any memory is allocated (the service checks
    it against the host's memory at start-up)."""

    num_blocks: int
    kv_bytes_per_offloaded_block: int


class ManagerSnapshot(Protocol):
    """What a manager's ``stats()`` reports about its CPU tier."""

    num_blocks: int
    policy: str
    free: int
    writing: int
    idle: int
    reading: int


@runtime_checkable
class CountsFencedSlots(Protocol):
    """A snapshot of a manager that fences slots: how many are out of use now."""

    fenced: int


@runtime_checkable
class ReportsStats(Protocol):
    """A manager that can describe its tier (the engine's stats, ``/v1/stats``)."""

    def stats(self) -> ManagerSnapshot: ...


@runtime_checkable
class FencesSlots(Protocol):
    """A manager that can drop keys but keep their slots out of use (sidecar lease expiry)."""

    def fence(self, keys: Sequence[OffloadKey]) -> list[int]: ...

    def release_fenced(self, block_ids: Sequence[int]) -> None: ...


@runtime_checkable
class DiscardsBlocks(Protocol):
    """A manager that takes the caller's word that blocks are dead (a closed session's own
    blocks): ``release`` evicts them first when room is needed, ``discard`` frees them now
    (see ``CPUOffloadingManager``)."""

    def discard(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]: ...

    def release(self, keys: Sequence[OffloadKey]) -> int: ...


@runtime_checkable
class EvictsAhead(Protocol):
    """A manager that can choose victims before a store asks: ``evict_ahead(n)`` chooses
    idle blocks until ``n`` slots are free or chosen, and returns how many it chose; they
    stay loadable until a store takes them (see ``CPUOffloadingManager``); it chooses
    nothing unless ``chooses_ahead`` (its policy's choice ahead is the one made at need)."""

    @property
    def chooses_ahead(self) -> bool: ...

    def evict_ahead(self, free_target: int) -> int: ...


@runtime_checkable
class SkipsStores(Protocol):
    """A manager that declines some stores (the reuse filter) and counts them."""

    stores_skipped: int


@runtime_checkable
class LookupObserver(Protocol):
    """Sees every lookup: the keys asked for and how many leading ones hit."""

    def on_lookup(self, keys: Sequence[OffloadKey], hits: int) -> None: ...


@runtime_checkable
class StoreObserver(Protocol):
    """Sees every store offer, before the manager decides."""

    def on_store(self, keys: Sequence[OffloadKey]) -> None: ...


@runtime_checkable
class CapacityObserver(Protocol):
    """Wants the CPU tier's capacity in blocks (to size a sample)."""

    def bind_capacity(self, num_blocks: int) -> None: ...


@runtime_checkable
class MissRatioReporter(Protocol):
    """Estimates the hit ratio at other capacities: ``({scale: ratio}, sampled keys)``."""

    def mrc_stats(self, capacity_blocks: int) -> tuple[Mapping[float, float], int]: ...


class ShadowSnapshot(Protocol):
    """What a shadow simulation reports: the live policy and each candidate's hits."""

    live: str
    hit_blocks: Mapping[str, int]
    sampled_blocks: int


@runtime_checkable
class ShadowReporter(Protocol):
    """Simulates candidate policies on a key sample next to the live one."""

    def shadow_stats(self) -> ShadowSnapshot: ...
