"""Two-step operations under a lease: a sidecar client moves the bytes, the engine the state.

``prepare_store``/``prepare_load`` reserve slots or pin blocks and open a lease;
``complete_store``/``complete_load`` close it. A lease that expires is rolled back without
letting its slots change owner until the grace period is over
(:mod:`kvcache_offload.aio.slot_fence`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvcache_offload.aio.engine_core import (
    LOAD_DIRECTION,
    STORE_DIRECTION,
    EngineCore,
    EnginePart,
    block_ids_of,
)
from kvcache_offload.aio.leases import Lease, LeaseTable
from kvcache_offload.aio.types import EventType, LoadLease, StoreLease
from kvcache_offload.contracts.manager import ReqContext
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import OffloadError

__all__ = ["LeaseOperations"]

logger = logging.getLogger("kvcache_offload.aio.engine")


def _lease_context(req_context: ReqContext | None, ttl_s: float | None) -> ReqContext:
    """The context a new lease keeps, once its TTL is known to be valid."""
    if ttl_s is not None:
        LeaseTable.check_ttl(ttl_s)
    return req_context if req_context is not None else ReqContext()


class LeaseOperations(EnginePart):
    """``prepare_store``/``complete_store``, ``prepare_load``/``complete_load``, lease expiry."""

    def __init__(self, core: EngineCore) -> None:
        super().__init__(core)
        core.lease_expired = self._on_lease_expired

    async def prepare_store(
        self,
        keys: Sequence[OffloadKey],
        req_context: ReqContext | None = None,
        ttl_s: float | None = None,
    ) -> StoreLease:
        """Allocate CPU slots for the keys not yet offloaded; complete within the TTL."""
        c = self._core
        ctx = _lease_context(req_context, ttl_s)
        if c._tiers is not None:
            await c._tier_room(list(keys))
        out = c._prepare_store(list(keys), ctx)
        lease = c._leases.add(
            "store",
            list(out.keys_to_store),
            block_ids_of(out.store_spec),
            ctx,
            ttl_s,
            list(out.evicted_keys),
        )
        c._ensure_started()
        return StoreLease(
            lease.lease_id, lease.keys, lease.block_ids, lease.evicted_keys, lease.expires_at
        )

    async def complete_store(
        self,
        lease_id: str,
        success: bool = True,
        transfer_bytes: int | None = None,
        transfer_seconds: float | None = None,
    ) -> list[OffloadKey]:
        """Make the lease's blocks loadable (or drop them); returns the keys now stored.

        A sidecar client may report the size and duration of its own copy so that transfer
        metrics cover bytes that never went through this process.
        """
        c = self._core
        c._check_open()
        lease = c._leases.pop(lease_id, "store")
        c._finish_store(lease.keys, lease.req_context, success, "client reported failure")
        if success:
            c._record_copy(STORE_DIRECTION, transfer_bytes, transfer_seconds)
        return list(lease.keys) if success else []

    async def prepare_load(
        self,
        keys: Sequence[OffloadKey],
        req_context: ReqContext | None = None,
        ttl_s: float | None = None,
    ) -> LoadLease:
        """Pin ready blocks for reading; :class:`BlockStateError` if one is not ready."""
        c = self._core
        ctx = _lease_context(req_context, ttl_s)
        keys = list(keys)
        if c._tiers is not None:
            await c._tiers.promote(keys)
        block_ids = c._prepare_load(keys, ctx)
        lease = c._leases.add("load", keys, block_ids, ctx, ttl_s)
        c._ensure_started()
        return LoadLease(lease.lease_id, lease.keys, lease.block_ids, lease.expires_at)

    async def complete_load(
        self,
        lease_id: str,
        transfer_bytes: int | None = None,
        transfer_seconds: float | None = None,
    ) -> None:
        """Unpin the lease's blocks; the client may report its copy as in complete_store."""
        c = self._core
        c._check_open()
        lease = c._leases.pop(lease_id, "load")
        c._finish_load(lease.keys, lease.req_context, True, {"lease_id": lease_id})
        c._record_copy(LOAD_DIRECTION, transfer_bytes, transfer_seconds)

    def _on_lease_expired(self, lease: Lease) -> None:
        c = self._core
        self._quarantine_lease(lease)
        c._hub.publish(
            EventType.LEASE_EXPIRED,
            lease.keys,
            detail={
                "lease_id": lease.lease_id,
                "kind": lease.kind,
                "req_id": lease.req_context.req_id,
            },
        )

    def _quarantine_lease(self, lease: Lease) -> None:
        """Roll an expired lease back without letting its slots change owner yet.

        The sidecar client may still be copying (see :mod:`kvcache_offload.aio.slot_fence`):
        a store lease's keys are dropped but its slots fenced, a load lease's blocks stay
        pinned, both until the grace period is over.
        """
        c = self._core
        fences = c._fences
        if not lease.keys or fences is None or c._quarantine.grace_s <= 0:
            c._rollback_lease(lease)
            return
        try:
            if lease.kind == "store":
                c._quarantine.fence(fences.fence(lease.keys))
                c._totals.store_blocks_failed += len(lease.keys)
                c._publish_manager_events()
            else:
                c._quarantine.pin(list(lease.keys), lease.req_context)
        except OffloadError:
            logger.exception("quarantining %s lease %s failed", lease.kind, lease.lease_id)
