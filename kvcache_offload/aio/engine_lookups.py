"""Lookups: which keys the engine holds, in vLLM's maximal-prefix sense.

* ``states[i]`` is each key's state: READY (loadable), WRITING (a store is in flight) or ABSENT.
* ``hits`` is the number of leading READY keys: what can be loaded now.
* ``pending`` is True when a WRITING key comes before the first ABSENT key: waiting for the
  store to finish would give a longer hit, so a scheduler should defer rather than load
  ``hits`` keys now (vLLM's ``None``).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcache_offload.aio.engine_core import EnginePart
from kvcache_offload.aio.tiering import CPU_TIER
from kvcache_offload.aio.types import KeyState, LookupResult
from kvcache_offload.contracts.capabilities import DiscardsBlocks
from kvcache_offload.contracts.manager import ReqContext
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import ConfigError

__all__ = ["Lookups"]

_READY, _WRITING, _ABSENT = KeyState.READY, KeyState.WRITING, KeyState.ABSENT
_STATE_OF: dict[bool | None, KeyState] = {True: _READY, None: _WRITING, False: _ABSENT}
_NO_CONTEXT = ReqContext()
"""Shared by calls that pass no context (managers only read it)."""


class Lookups(EnginePart):
    """``lookup``, ``lookup_now``, ``touch``, ``discard`` and ``release``."""

    async def lookup(
        self,
        keys: Sequence[OffloadKey],
        req_context: ReqContext | None = None,
        *,
        prefix_only: bool = False,
    ) -> LookupResult:
        """Per-key states plus the ready prefix and vLLM's "retry later" flag.

        With ``prefix_only`` the walk stops at the first absent key (as vLLM's does), so
        ``states`` covers only the keys up to and including it. With secondary tiers, keys the
        CPU tier lacks are looked up below (one batch per tier) and ``tiers`` names each key's.
        """
        c = self._core
        result = self.lookup_now(keys, req_context, prefix_only=prefix_only)
        if c._tiers is None or result.tiers is not None:
            return result
        return await c._tiers.extend_lookup(keys, result, prefix_only=prefix_only)

    def lookup_now(
        self,
        keys: Sequence[OffloadKey],
        req_context: ReqContext | None = None,
        *,
        prefix_only: bool = False,
    ) -> LookupResult:
        """:meth:`lookup` without the coroutine, for callers already on the loop thread."""
        c = self._core
        ctx = req_context if req_context is not None else _NO_CONTEXT
        lookup = c.manager.lookup
        if prefix_only:
            states: list[KeyState] = []
            append = states.append
            hits = -1
            pending = False
            for key in keys:
                found = lookup(key, ctx)
                if found:
                    append(_READY)
                    continue
                if hits < 0:
                    hits = len(states)
                if found is None:
                    append(_WRITING)
                    pending = True
                else:
                    append(_ABSENT)
                    break
            if hits < 0:
                hits = len(states)
        else:
            # Comprehensions and list.index run at C speed: this is the hot path of /v1/lookup.
            answers = [lookup(key, ctx) for key in keys]
            states = [_STATE_OF[found] for found in answers]
            n = len(answers)
            first_absent = answers.index(False) if False in answers else n
            first_writing = answers.index(None) if None in answers else n
            hits = min(first_absent, first_writing)
            pending = first_writing < first_absent
        totals = c._totals
        totals.lookups += 1
        totals.lookup_keys += len(keys)
        totals.lookup_hit_blocks += hits
        if c._observers.watches_lookups:
            c._observers.on_lookup(keys, hits)
        # With tiers, an all-CPU answer names its tier here (the cheap, common case).
        tiers: list[str | None] | None = None
        if c._tiers is not None and hits == len(states):
            tiers = [CPU_TIER] * hits
        return LookupResult(hits=hits, pending=pending, states=states, tiers=tiers)

    async def touch(
        self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None
    ) -> None:
        """Mark keys recently used; the first key ends up most recently used."""
        c = self._core
        c.manager.touch(keys, req_context if req_context is not None else _NO_CONTEXT)

    async def discard(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """Free the CPU tier's idle blocks of ``keys`` now, because nobody will ask for them
        again: a serving engine calls it with a session's own keys when the session ends
        (the keys its stores returned). Returns the keys freed; absent keys and blocks being
        written or read are left alone. Subscribers see them evicted.

        No policy can tell a dead block from one whose session is just pausing, and on the
        Mooncake conversation trace that knowledge is worth more than any policy
        (``docs/policy-lab.md``, "Session-end hints"). A key discarded too early only costs a
        miss: it is stored again on its next request."""
        return self.discard_now(keys)

    async def release(self, keys: Sequence[OffloadKey]) -> int:
        """The soft form of :meth:`discard`: ``keys`` are evicted first when room is
        needed, unless asked for again meanwhile; until then they stay loadable. Returns how
        many present keys were marked. For a session that probably ended (a timeout rather
        than a close): a wrong hint costs nothing while the tier has room."""
        c = self._core
        c._check_open()
        return self._discarding_manager().release(keys)

    def _discarding_manager(self) -> DiscardsBlocks:
        c = self._core
        manager = c.manager
        if not isinstance(manager, DiscardsBlocks):
            raise ConfigError(f"{type(manager).__name__} cannot discard or release blocks")
        return manager

    def discard_now(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """:meth:`discard` for callers already on the loop thread."""
        c = self._core
        c._check_open()
        dropped = self._discarding_manager().discard(keys)
        c._publish_manager_events()
        return dropped
