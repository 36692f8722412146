"""The scheduler-side manager contract: lookup, prepare/complete load and store, events.

The manager decides and never touches memory; the handlers move bytes and never decide.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvcache_offload.contracts.load_store_spec import LoadStoreSpec
from kvcache_offload.contracts.offload_key import OffloadKey

__all__ = ["OffloadingEvent", "OffloadingManager", "PrepareStoreOutput", "ReqContext"]


@dataclass
class ReqContext:
    """Per-request information passed to every manager call."""

    req_id: str = ""
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class PrepareStoreOutput:
    """Which keys to store, where (spec co-indexed with keys) and what was evicted for them."""

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass
class OffloadingEvent:
    """Keys that became loadable (``removed=False``) or were evicted (``removed=True``)."""

    keys: list[OffloadKey]
    medium: str
    removed: bool


class OffloadingManager(ABC):
    """Scheduler-side bookkeeping of offloaded blocks; never touches memory.

    ``lookup`` answers True (ready), False (absent) or None (present but being written:
    retry later).
    """

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """Whether ``key`` is offloaded and ready (True), absent (False) or pending (None)."""

    @abstractmethod
    def prepare_load(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pin ready blocks for reading; the spec's ids are co-indexed with ``keys``."""

    def touch(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> None:  # noqa: B027
        """Mark blocks recently used; the first key ends up most recently used."""

    def complete_load(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> None:  # noqa: B027
        """Unpin blocks pinned by :meth:`prepare_load`."""

    @abstractmethod
    def prepare_store(
        self, keys: Sequence[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Allocate slots for the keys not yet offloaded, evicting if needed; None if it can't."""

    def complete_store(  # noqa: B027
        self, keys: Sequence[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """Make stored blocks loadable, or drop them when the transfer failed."""

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Drain the events emitted since the last call."""
        return ()

    def reset_cache(self) -> None:  # noqa: B027
        """Drop every offloaded block (callers must have drained in-flight transfers)."""

    def shutdown(self) -> None:  # noqa: B027
        """Release resources."""
