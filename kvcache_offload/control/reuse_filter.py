"""Store only blocks offered for storing often enough: one-off prefixes never reach the CPU tier.

Counts are kept per key in an LRU-bounded table and incremented each time a key is offered
to ``prepare_store`` (not on lookups: vLLM #52227), so an N-block prefix becomes eligible
after ``store_threshold`` offers whatever its length.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvcache_offload.contracts.load_store_spec import LoadStoreSpec
from kvcache_offload.contracts.manager import (
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
)
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import ConfigError

__all__ = ["FilterReusedOffloadingManager"]


class FilterReusedOffloadingManager(OffloadingManager):
    """Decorator over any manager that filters ``prepare_store`` by offer count."""

    def __init__(
        self,
        backing: OffloadingManager,
        store_threshold: int = 2,
        max_tracker_size: int = 64_000,
    ) -> None:
        if not isinstance(store_threshold, int) or store_threshold < 2:
            raise ConfigError(
                f"store_threshold must be an int >= 2 (1 would filter nothing), "
                f"got {store_threshold!r}"
            )
        if not isinstance(max_tracker_size, int) or max_tracker_size < 1:
            raise ConfigError(f"max_tracker_size must be an int >= 1, got {max_tracker_size!r}")
        self.backing = backing
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self.counts: OrderedDict[OffloadKey, int] = OrderedDict()
        self.stores_skipped = 0

    def _record_offer(self, key: OffloadKey) -> int:
        counts = self.counts
        count = counts.get(key)
        if count is None:
            if len(counts) >= self.max_tracker_size:
                counts.popitem(last=False)
            count = 1
        else:
            count += 1
            counts.move_to_end(key)
        counts[key] = count
        return count

    def prepare_store(
        self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None
    ) -> PrepareStoreOutput | None:
        threshold = self.store_threshold
        backing_lookup = self.backing.lookup
        eligible: list[OffloadKey] = []
        skipped = 0
        for key in keys:
            if self._record_offer(key) >= threshold:
                eligible.append(key)
            elif backing_lookup(key, req_context) is not False:  # type: ignore[arg-type]
                # Already offloaded (or being written): pass it on so it stays protected.
                eligible.append(key)
            else:
                skipped += 1
        self.stores_skipped += skipped
        return self.backing.prepare_store(eligible, req_context)  # type: ignore[arg-type]

    def lookup(self, key: OffloadKey, req_context: ReqContext | None = None) -> bool | None:
        return self.backing.lookup(key, req_context)  # type: ignore[arg-type]

    def prepare_load(
        self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None
    ) -> LoadStoreSpec:
        return self.backing.prepare_load(keys, req_context)  # type: ignore[arg-type]

    def touch(self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None) -> None:
        self.backing.touch(keys, req_context)  # type: ignore[arg-type]

    def complete_load(
        self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None
    ) -> None:
        self.backing.complete_load(keys, req_context)  # type: ignore[arg-type]

    def complete_store(
        self,
        keys: Sequence[OffloadKey],
        req_context: ReqContext | None = None,
        success: bool = True,
    ) -> None:
        self.backing.complete_store(keys, req_context, success)  # type: ignore[arg-type]

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self.backing.take_events()

    def reset_cache(self) -> None:
        self.counts.clear()
        self.backing.reset_cache()

    def shutdown(self) -> None:
        self.backing.shutdown()

    def __getattr__(self, name: str) -> object:
        # stats(), policy, num_blocks ... of the backing manager stay reachable.
        return getattr(self.backing, name)
