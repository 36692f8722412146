"""A lookup across tiers: the CPU tier's answer extended by the tiers below, in one batch.

Only the keys the CPU tier lacks are asked below, one batch per tier. A key held below is
ready (a load promotes it); a key evicted and still queued for the first tier (parked) is
reported as held there, so a key is never held nowhere between its eviction and its write.
Prefix semantics hold across tiers: ``hits`` counts the leading keys ready in some tier.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvcache_offload.aio.types import KeyState, LookupResult
from kvcache_offload.contracts.manager import OffloadingManager, ReqContext
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.tiers.tier_set import TierSet

__all__ = ["CPU_TIER", "cpu_answer", "lookup_below"]

CPU_TIER = "CPU"
_CTX = ReqContext()
_READY, _WRITING, _ABSENT = KeyState.READY, KeyState.WRITING, KeyState.ABSENT


def _index(states: list[KeyState], state: KeyState, default: int) -> int:
    try:
        return states.index(state)
    except ValueError:
        return default


def cpu_answer(cpu: LookupResult) -> LookupResult:
    """The CPU tier's answer with its tiers filled in (nothing to ask below)."""
    hits = cpu.hits
    tiers: list[str | None] = [CPU_TIER] * hits
    if len(cpu.states) > hits:
        tiers += [CPU_TIER if s is KeyState.READY else None for s in cpu.states[hits:]]
    return LookupResult(hits, cpu.pending, cpu.states, tiers)


async def lookup_below(
    tier_set: TierSet,
    manager: OffloadingManager,
    parked: Mapping[OffloadKey, object],
    keys: Sequence[OffloadKey],
    cpu: LookupResult,
    *,
    prefix_only: bool,
) -> LookupResult:
    """``cpu`` (a ready prefix shorter than ``keys``) extended across the tiers."""
    n = len(keys)
    hits = cpu.hits
    lookup = manager.lookup
    rest = keys[hits:]
    tail = [lookup(k, _CTX) for k in rest]
    absent = [k for k, found in zip(rest, tail, strict=True) if found is False]
    below = await tier_set.lookup(absent) if absent else {}
    if parked:  # on their way to the first tier: reported there
        first = tier_set.tiers[0].name
        for k in absent:
            if k in parked and k not in below:
                below[k] = first
    # Comprehensions and list.index, as in lookup_now: this runs for every lookup that
    # reaches below the CPU tier. A key held below is ready (the load promotes it).
    where_rest = [
        CPU_TIER if found else below.get(k) if found is False else None
        for k, found in zip(rest, tail, strict=True)
    ]
    states_rest = [
        _READY if tier is not None else _WRITING if found is None else _ABSENT
        for tier, found in zip(where_rest, tail, strict=True)
    ]
    if prefix_only and _ABSENT in states_rest:  # the walk stops at the first key held nowhere
        stop = states_rest.index(_ABSENT) + 1
        del where_rest[stop:], states_rest[stop:]
    states = cpu.states[:hits] + states_rest
    where: list[str | None] = [CPU_TIER] * hits
    where += where_rest
    first_absent = _index(states, _ABSENT, n)
    first_writing = _index(states, _WRITING, n)
    new_hits = min(first_absent, first_writing)
    pending = first_writing < first_absent
    return LookupResult(new_hits, pending, states, where)
