"""Scheduler-side bookkeeping of the CPU tier: slots, ref counts, eviction and events.

Called from one thread only (the event loop in the async core), so it takes no locks. Every
mutating call validates all of its input before changing anything: a call that raises leaves
the manager exactly as it was.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, cast

from mypy_extensions import mypyc_attr

from kvcache_offload.contracts.load_store_spec import CPULoadStoreSpec
from kvcache_offload.contracts.manager import (
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
)
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control import _caller_hints, _chosen_ahead, _eviction, _fences
from kvcache_offload.control._manager_io import (
    MEDIUM,
    blocks_at_least,
    check_keys,
    cpu_spec,
    event,
    raise_overdrawn,
    store_output,
)
from kvcache_offload.control.manager_stats import CPUManagerStats, snapshot
from kvcache_offload.control.policies.base import BlockStatus, CachePolicy
from kvcache_offload.control.policies.registry import get_cache_policy_cls
from kvcache_offload.errors import ConfigError

__all__ = ["CPUManagerStats", "CPUOffloadingManager"]


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled, still subclassable
class CPUOffloadingManager(OffloadingManager):
    """vLLM's classic CPU manager: fresh slot ids ascending, then freed ids LIFO.

    ``cache_policy`` is a registered policy name ("lru", "arc", ...), a "module:Class" path,
    or a :class:`CachePolicy` subclass.
    """

    medium: ClassVar[str] = MEDIUM

    def __init__(
        self,
        num_blocks: int,
        cache_policy: str | type[CachePolicy] = "lru",
        enable_events: bool = False,
    ) -> None:
        # A compiled build rejects a non-int before this line with its own TypeError.
        if not isinstance(num_blocks, int):
            raise TypeError(f"num_blocks must be an int, got {num_blocks!r}")
        if num_blocks < 0:
            raise ConfigError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        policy_cls = (
            cache_policy
            if isinstance(cache_policy, type) and issubclass(cache_policy, CachePolicy)
            else get_cache_policy_cls(cache_policy)  # type: ignore[arg-type]
        )
        self._num_blocks = num_blocks
        self._policy: CachePolicy = policy_cls(cache_capacity=num_blocks)
        # Every present key -> its block, whatever the policy: lookups stay one dict probe.
        self._blocks: dict[OffloadKey, BlockStatus] = {}
        # A policy with one key -> block dict (LRU) lends it: no second copy to maintain.
        shared = self._policy.block_table()
        self._shared_table = shared is not None
        if shared is not None:
            self._blocks = shared
        self._policy_name = policy_cls.name or policy_cls.__name__
        self._num_allocated = 0
        self._free_list: list[BlockStatus] = []
        # Slots taken from their keys but not reusable yet: a sidecar client may still write.
        self._fenced: dict[int, BlockStatus] = {}
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self._writing = 0
        self._reading = 0
        self._evictions = 0
        self._rejected_stores = 0
        self._stored_blocks = 0
        self._failed_store_blocks = 0
        self._loaded_blocks = 0
        self._discarded_blocks = 0
        self._released_evictions = 0
        # Keys the caller released (``release``), oldest first: evicted before the policy
        # is asked, unless used again meanwhile. Every key here is held: a released key
        # leaves only through ``_take_released`` or ``_forget``, which drop its mark (the
        # policy is never asked to evict one: ``_released_victims`` pins them all first).
        self._released: dict[OffloadKey, None] = {}
        # Idle blocks chosen ahead of the next store (``evict_ahead``), oldest first: out of
        # the policy and the table, still loadable (lookups and loads find them here, and a
        # use puts them back), taken first when a store needs room.
        self._ahead: dict[OffloadKey, BlockStatus] = {}
        self._ahead_evictions = 0
        self._ahead_rescued = 0

    # -- introspection -------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def policy(self) -> CachePolicy:
        return self._policy

    @property
    def chooses_ahead(self) -> bool:
        """Whether :meth:`evict_ahead` chooses anything: where the policy's choice ahead is
        the one it makes at need (``CachePolicy.chooses_ahead``)."""
        return bool(self._policy.chooses_ahead)

    def _num_free(self) -> int:
        return len(self._free_list) + self._num_blocks - self._num_allocated

    def _num_idle(self) -> int:
        """Blocks neither free, fenced, being written nor being read: the only evictable ones."""
        return (
            self._num_blocks - self._num_free() - self._writing - self._reading - len(self._fenced)
        )

    def stats(self) -> CPUManagerStats:
        return snapshot(self)

    # -- lookups and loads ---------------------------------------------------------------

    def lookup(self, key: Any, req_context: ReqContext | None = None) -> bool | None:
        # ``key: Any``: a malformed key must raise InvalidKeyError, also when compiled.
        block = self._blocks.get(key)
        if block is None:
            if self._ahead and key in self._ahead:  # chosen ahead: loadable until taken
                return True
            check_keys((key,))
            return False
        return None if block.ref_cnt == -1 else True

    def prepare_load(
        self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None
    ) -> CPULoadStoreSpec:
        blocks = blocks_at_least(self, keys, 0, "load", "ready")
        if self._ahead:
            _chosen_ahead.rescue(self, keys)
        newly_read = 0
        for block in blocks:
            if block.ref_cnt == 0:
                newly_read += 1
            block.ref_cnt += 1
        self._reading += newly_read
        # The blocks' own id objects: compiled, ``block_id`` would be boxed anew per block.
        return cpu_spec([block.block_id_object for block in blocks])

    def touch(self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None) -> None:
        check_keys(keys)
        if self._released:  # a released key asked for again was not dead after all
            released = self._released
            for key in keys:
                released.pop(key, None)
        if self._ahead:
            _chosen_ahead.rescue(self, keys)
        self._policy.touch(keys)

    def complete_load(
        self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None
    ) -> None:
        blocks = blocks_at_least(self, keys, 1, "complete a load of", "being read")
        # A key listed more often than it has loads in flight drives its count below zero:
        # only then are the counts restored and the offending key named.
        now_idle = 0
        overdrawn = False
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                now_idle += 1
            elif block.ref_cnt < 0:
                overdrawn = True
        if overdrawn:
            for block in blocks:
                block.ref_cnt += 1
            raise_overdrawn(self._blocks, keys)
        self._reading -= now_idle
        self._loaded_blocks += len(blocks)

    # -- stores --------------------------------------------------------------------------

    def prepare_store(
        self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None
    ) -> PrepareStoreOutput | None:
        table = self._blocks
        keys_to_store: list[OffloadKey] = []
        distinct: set[OffloadKey] = set()  # built in the loop: cheaper than ``set(list)``
        present: list[BlockStatus] = []
        rescued: list[OffloadKey] = []  # keys chosen ahead: present, kept once checked
        # The keys are checked in this loop (``check_keys`` per key, as it goes): a bytes key
        # found in the table equals a stored key, so only the absent ones need their length
        # checked. Nothing changes before the loop ends, and the first malformed key raises.
        # Compiled: no cast to bytes before the check, and a list (the usual argument) is
        # walked by index, not through a generic iterator step per key.
        items: list[Any] = keys if isinstance(keys, list) else list(keys)
        for key in items:
            if type(key) is not bytes:
                check_keys((key,))  # InvalidKeyError, unless a bytes subclass: then usable
            block = table.get(key)
            if block is None and self._ahead:
                block = self._ahead.get(key)
                if block is not None:
                    rescued.append(key)
            if block is None:
                if len(cast(bytes, key)) <= 4:
                    check_keys((key,))
                keys_to_store.append(key)
                distinct.add(key)
            elif block.ref_cnt >= 0:
                present.append(block)
        if not keys_to_store:
            if rescued:
                _chosen_ahead.rescue(self, rescued)
            return store_output([], cpu_spec([]), [])
        if len(distinct) != len(keys_to_store):
            keys_to_store = list(dict.fromkeys(keys_to_store))

        if rescued:  # chosen ahead, and asked for again: kept (nothing raises from here)
            _chosen_ahead.rescue(self, rescued)
        needed = len(keys_to_store) - self._num_free()
        evicted_keys: list[OffloadKey] = []
        recycled: list[BlockStatus] = []  # this call's victims (two lists: no tuple each)
        if needed > 0 and not _eviction.evict(self, needed, present, evicted_keys, recycled):
            self._rejected_stores += 1
            return None

        # Slots: fresh ids in ascending order first, then freed slots, most recently freed
        # first: this call's victims last to first (as if pushed on the free list and popped
        # straight back), then the free list. Freed slots keep their BlockStatus (already
        # reset to "being written"), so steady-state stores allocate nothing.
        new_blocks: list[BlockStatus] = []
        block_ids: list[object] = []  # the blocks' id objects: no int boxed per block
        next_fresh = self._num_allocated
        num_blocks = self._num_blocks
        free_list = self._free_list
        unused = len(recycled)
        for _slot in range(len(keys_to_store)):  # not ``_``: compiled, an int object per step
            if next_fresh < num_blocks:
                block = BlockStatus(next_fresh)
                next_fresh += 1
            elif unused:
                unused -= 1
                block = recycled[unused]
            else:
                block = free_list.pop()
            new_blocks.append(block)
            block_ids.append(block.block_id_object)
        self._num_allocated = next_fresh
        if unused:  # a policy that evicted more than asked: its extra slots stay usable
            free_list.extend(recycled[:unused])
        if not self._shared_table:
            for index in range(len(keys_to_store)):
                table[keys_to_store[index]] = new_blocks[index]
        if self._released:  # a key stored again is alive, whatever was released before
            released = self._released
            for key in keys_to_store:
                released.pop(key, None)
        # Two lists, not (key, block) pairs: compiled, a tuple per stored block costs.
        self._policy.insert_blocks(keys_to_store, new_blocks)
        self._writing += len(keys_to_store)
        return store_output(keys_to_store, cpu_spec(block_ids), evicted_keys)

    def complete_store(
        self,
        keys: Sequence[OffloadKey],
        req_context: ReqContext | None = None,
        success: bool = True,
    ) -> None:
        check_keys(keys)  # before any change: a bad key in the middle must change nothing
        table = self._blocks
        if success:
            events = self.events
            if events is None:
                count = 0
                # A list is walked by index (compiled: no generic iterator step per key).
                key_list = keys if isinstance(keys, list) else list(keys)
                for key in key_list:
                    block = table.get(key)
                    if block is not None and block.ref_cnt == -1:
                        block.ref_cnt = 0
                        count += 1
            else:
                stored: list[OffloadKey] = []
                for key in keys:
                    block = table.get(key)
                    if block is not None and block.ref_cnt == -1:
                        block.ref_cnt = 0
                        stored.append(key)
                count = len(stored)
                if stored:
                    events.append(event(stored, False))
            self._writing -= count
            self._stored_blocks += count
            return
        free_list = self._free_list
        failed = 0
        for key in keys:
            block = table.get(key)
            if block is not None and block.ref_cnt == -1:
                self._forget(key, block)
                free_list.append(block)
                failed += 1
        self._writing -= failed
        self._failed_store_blocks += failed

    def _forget(self, key: OffloadKey, block: BlockStatus) -> None:
        """Drop ``key`` from the policy, the table and the released marks, its slot left as
        a new store needs it (``ref_cnt`` -1): the one way a key leaves outside an eviction
        (a failed store, a discard, a fence), so no route forgets one of the three. The
        caller frees or fences the slot. A key chosen ahead leaves by
        :meth:`_forget_chosen` instead."""
        self._policy.remove(key)
        if not self._shared_table:
            del self._blocks[key]
        block.ref_cnt = -1
        if self._released:
            self._released.pop(key, None)

    # -- victims chosen ahead, the caller's hints, fences ---------------------------------

    def evict_ahead(self, free_target: int) -> int:
        """Choose now the idle blocks the next store would evict, so that ``free_target``
        slots are free or chosen (as many as are idle, when fewer); returns how many were
        chosen. They leave the policy but stay loadable (a lookup finds them, a load or a
        touch keeps them) until a store needs their slots: it takes them first, and only
        then are they evicted, published and counted as evictions (``_chosen_ahead.py``)."""
        return _eviction.evict_ahead(self, free_target)

    def release(self, keys: Sequence[OffloadKey]) -> int:
        """Mark ``keys`` as probably dead (a closed session's own blocks): when room is
        needed they are evicted first, oldest release first, before the policy chooses; a
        key used again (``touch``) meanwhile is kept as the policy would. Returns how many
        present keys were marked. The soft form of :meth:`discard`: nothing leaves until
        its slot is wanted, so a wrong hint costs nothing while the cache has room.

        Blocks chosen ahead go back to the policy first (``evict_ahead`` chooses none while
        released keys wait): at need the released keys leave before the policy's choice."""
        return _caller_hints.release(self, keys)

    def discard(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """Free the idle blocks of ``keys`` now: the caller knows nobody will ask for them
        again (a closed session's own blocks). Returns the keys dropped, published as one
        eviction event; absent keys and blocks being written or read are left as they are."""
        return _caller_hints.discard(self, keys)

    def fence(self, keys: Sequence[OffloadKey]) -> list[int]:
        """Drop ``keys`` (in any state) but keep their slots from reuse; returns the slot ids.

        For slots a client outside this process may still write (an expired or reset
        sidecar store lease): handing such a slot to another key would let the late bytes
        land in that key's ready block. :meth:`release_fenced` makes them free again.
        """
        return _fences.fence(self, keys)

    def release_fenced(self, block_ids: Sequence[int]) -> None:
        """Make fenced slots free again (unknown ids are ignored: a reset may have freed them)."""
        _fences.release_fenced(self, block_ids)

    # -- events and lifecycle ------------------------------------------------------------

    def take_events(self) -> Iterator[OffloadingEvent]:
        if self.events is None:
            return
        events, self.events = self.events, []
        yield from events

    def reset_cache(self) -> None:
        """Drop every block; fenced slots stay fenced (their writers may still be running)."""
        self._policy.clear()
        self._blocks.clear()
        self._released.clear()
        self._ahead.clear()
        self._free_list.clear()
        self._num_allocated = 0
        self._writing = 0
        self._reading = 0
        if self._fenced:
            # Everything else is free again, handed out in ascending order as after a start.
            fenced = self._fenced
            self._free_list = [
                BlockStatus(block_id)
                for block_id in range(self._num_blocks - 1, -1, -1)
                if block_id not in fenced
            ]
            self._num_allocated = self._num_blocks

    def shutdown(self) -> None:
        self.reset_cache()
