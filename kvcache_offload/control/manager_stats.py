"""The manager's stats: block counts by state and cumulative counters, as one snapshot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcache_offload.control.manager import CPUOffloadingManager

__all__ = ["CPUManagerStats", "snapshot"]


@dataclass(frozen=True)
class CPUManagerStats:
    """A cheap snapshot: block counts by state plus cumulative counters."""

    num_blocks: int
    free: int
    writing: int
    idle: int
    reading: int
    evictions: int
    rejected_stores: int
    stored_blocks: int
    failed_store_blocks: int
    loaded_blocks: int
    policy: str
    fenced: int = 0
    """Slots held back from reuse because a client may still write them (see ``fence``)."""
    discarded_blocks: int = 0
    """Blocks freed on a caller's word that nobody needs them again (see ``discard``)."""
    released_evictions: int = 0
    """Evictions that took a released block before asking the policy (see ``release``)."""
    released: int = 0
    """Blocks released and not evicted yet: at most the blocks held (a gauge)."""
    chosen_ahead: int = 0
    """Idle blocks the policy chose ahead of the next store (see ``evict_ahead``): still
    loadable, the first to go when room is needed (a gauge)."""
    ahead_evictions: int = 0
    """Evictions that took a block chosen ahead (also in ``evictions``)."""
    ahead_rescued: int = 0
    """Blocks chosen ahead, then put back before their slot was needed: used again, or
    every chosen one when keys were released (see ``release``)."""

    @property
    def used(self) -> int:
        return self.num_blocks - self.free


def snapshot(m: CPUOffloadingManager) -> CPUManagerStats:
    """The stats of ``m`` now (``CPUOffloadingManager.stats``)."""
    return CPUManagerStats(
        num_blocks=m._num_blocks,
        free=m._num_free(),
        writing=m._writing,
        idle=m._num_idle(),
        reading=m._reading,
        evictions=m._evictions,
        rejected_stores=m._rejected_stores,
        stored_blocks=m._stored_blocks,
        failed_store_blocks=m._failed_store_blocks,
        loaded_blocks=m._loaded_blocks,
        policy=m._policy_name,
        fenced=len(m._fenced),
        discarded_blocks=m._discarded_blocks,
        released_evictions=m._released_evictions,
        released=len(m._released),
        chosen_ahead=len(m._ahead),
        ahead_evictions=m._ahead_evictions,
        ahead_rescued=m._ahead_rescued,
    )
