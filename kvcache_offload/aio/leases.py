"""Leases: prepared stores and loads that a client completes itself, each with a deadline.

A lease pins manager state (a store's slots being written, a load's blocks being read)
until the client completes it. A client that crashes never completes it, so every lease has
a TTL; the reaper task pops expired leases and hands them to the engine, which rolls them
back (store: failed; load: released). A lease is used at most once: completing, expiring and
rolling back all remove it first, so no path can release the same pins twice.

The table runs on the event-loop thread; the reaper sleeps until the earliest deadline, so
it costs nothing when no lease is open.
"""

from __future__ import annotations

import heapq
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from kvcache_offload.aio._waker import Waker
from kvcache_offload.contracts.manager import ReqContext
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import ConfigError, LeaseError, LeaseExpiredError, LeaseLimitError

__all__ = ["Lease", "LeaseKind", "LeaseTable"]

logger = logging.getLogger(__name__)

LeaseKind = Literal["store", "load"]

_REMEMBER_EXPIRED = 10_000
"""Expired lease ids remembered so a late completion hears "expired", not "unknown"."""

EMPTY_LEASE_PREFIX = "empty-"
"""Ids of leases that hold nothing (every key already stored, or no key): never kept in the
table, so they cost no memory, and completing one is a no-op."""


@dataclass
class Lease:
    lease_id: str
    kind: LeaseKind
    keys: list[OffloadKey]
    block_ids: list[int]
    req_context: ReqContext
    deadline: float
    """``time.monotonic()`` after which the lease expires."""
    expires_at: float
    """The same instant as Unix time, for clients."""
    evicted_keys: list[OffloadKey] = field(default_factory=list)


class LeaseTable:
    """Open leases by id plus a heap of deadlines; ``on_expire`` rolls an expired lease back."""

    def __init__(
        self,
        on_expire: Callable[[Lease], None],
        default_ttl_s: float,
        max_open: int = 65_536,
    ) -> None:
        self.check_ttl(default_ttl_s)
        self.default_ttl_s = default_ttl_s
        self.max_open = max_open
        self._on_expire = on_expire
        self._leases: dict[str, Lease] = {}
        self._deadlines: list[tuple[float, str]] = []
        self._waker = Waker()
        self.expired: dict[str, int] = {"store": 0, "load": 0}
        self._recently_expired: OrderedDict[str, None] = OrderedDict()

    @staticmethod
    def check_ttl(ttl_s: float) -> None:
        """Raise :class:`ConfigError` unless ``ttl_s`` is a positive number of seconds."""
        if not ttl_s > 0:
            raise ConfigError(f"lease TTL must be > 0 seconds, got {ttl_s!r}")

    def __len__(self) -> int:
        return len(self._leases)

    def add(
        self,
        kind: LeaseKind,
        keys: list[OffloadKey],
        block_ids: list[int],
        req_context: ReqContext,
        ttl_s: float | None = None,
        evicted_keys: list[OffloadKey] | None = None,
    ) -> Lease:
        ttl = self.default_ttl_s if ttl_s is None else ttl_s
        self.check_ttl(ttl)
        if not keys:  # holds nothing: not kept, completing it is a no-op
            return Lease(
                lease_id=EMPTY_LEASE_PREFIX + uuid.uuid4().hex,
                kind=kind,
                keys=[],
                block_ids=[],
                req_context=req_context,
                deadline=time.monotonic() + ttl,
                expires_at=time.time() + ttl,
                evicted_keys=evicted_keys or [],
            )
        if len(self._leases) >= self.max_open:
            self.expire_due()
            if len(self._leases) >= self.max_open:
                raise LeaseLimitError(
                    f"{len(self._leases)} leases are open, the most allowed "
                    f"(max_open_leases={self.max_open}): complete some first"
                )
        lease = Lease(
            lease_id=uuid.uuid4().hex,
            kind=kind,
            keys=keys,
            block_ids=block_ids,
            req_context=req_context,
            deadline=time.monotonic() + ttl,
            expires_at=time.time() + ttl,
            evicted_keys=evicted_keys or [],
        )
        self._leases[lease.lease_id] = lease
        earliest = self._deadlines[0][0] if self._deadlines else None
        heapq.heappush(self._deadlines, (lease.deadline, lease.lease_id))
        if earliest is None or lease.deadline < earliest:
            self._waker.wake()
        return lease

    def pop(self, lease_id: str, kind: LeaseKind) -> Lease:
        """Remove and return an open lease; expired or unknown ids raise :class:`LeaseError`."""
        if lease_id.startswith(EMPTY_LEASE_PREFIX):
            return Lease(lease_id, kind, [], [], ReqContext(), 0.0, 0.0)
        lease = self._leases.get(lease_id)
        if lease is not None and time.monotonic() >= lease.deadline:
            self.expire_due()
            lease = None
        if lease is None or lease.kind != kind:
            if lease_id in self._recently_expired:
                raise LeaseExpiredError(f"{kind} lease {lease_id!r} expired and was rolled back")
            raise LeaseError(f"no open {kind} lease {lease_id!r} (unknown or already completed)")
        del self._leases[lease_id]
        return lease

    def expire_due(self) -> int:
        """Expire every lease past its deadline; returns how many."""
        now = time.monotonic()
        heap = self._deadlines
        count = 0
        while heap and heap[0][0] <= now:
            _, lease_id = heapq.heappop(heap)
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                continue  # completed before its deadline
            self.expired[lease.kind] += 1
            count += 1
            self._recently_expired[lease_id] = None
            if len(self._recently_expired) > _REMEMBER_EXPIRED:
                self._recently_expired.popitem(last=False)
            try:
                self._on_expire(lease)
            except Exception:
                logger.exception("rolling back expired %s lease %s failed", lease.kind, lease_id)
        return count

    def take_all(self) -> list[Lease]:
        """Remove every open lease (for reset and shutdown) without counting them as expired."""
        leases = list(self._leases.values())
        self._leases.clear()
        self._deadlines.clear()
        return leases

    async def run(self) -> None:
        """Reaper loop: sleep until the next deadline (or forever when none), then expire."""
        while True:
            self.expire_due()
            heap = self._deadlines
            while heap and heap[0][1] not in self._leases:
                heapq.heappop(heap)  # completed leases: drop their stale deadlines
            timeout = max(0.0, heap[0][0] - time.monotonic()) if heap else None
            await self._waker.wait(timeout)
