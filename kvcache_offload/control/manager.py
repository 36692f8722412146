"""Scheduler-side bookkeeping of the CPU tier: slots, ref counts, eviction and events.

Called from one thread only (the event loop in the async core), so it takes no locks. Every
mutating call validates all of its input before changing anything: a call that raises leaves
the manager exactly as it was.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final, cast

from mypy_extensions import mypyc_attr

from kvcache_offload.contracts.load_store_spec import CPULoadStoreSpec
from kvcache_offload.contracts.manager import (
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
)
from kvcache_offload.contracts.offload_key import OffloadKey, validate_offload_key
from kvcache_offload.control.policies.base import BlockStatus, CachePolicy
from kvcache_offload.control.policies.registry import get_cache_policy_cls
from kvcache_offload.errors import BlockStateError, ConfigError

__all__ = ["CPUManagerStats", "CPUOffloadingManager"]

MEDIUM = "CPU"

_NOTHING_PROTECTED: frozenset[OffloadKey] = frozenset()

# Final: compiled, these are C statics, not a module-dict lookup per use.
_new_object: Final = object.__new__
_SPEC_CLASS: Final = CPULoadStoreSpec
_OUTPUT_CLASS: Final = PrepareStoreOutput
_EVENT_CLASS: Final = OffloadingEvent


def _cpu_spec(block_ids: list[object]) -> CPULoadStoreSpec:
    """``CPULoadStoreSpec.from_owned_list(block_ids)``, built here: the spec and the output
    classes are interpreted (numpy), and their constructors' Python frames cost more than
    the rest of a small store (tests check the result stays equal to theirs)."""
    spec: Any = _new_object(_SPEC_CLASS)
    spec._owned_ids = block_ids
    spec._block_ids = None
    return cast(CPULoadStoreSpec, spec)


def _event(keys: list[OffloadKey], removed: bool) -> OffloadingEvent:
    """``OffloadingEvent(keys, MEDIUM, removed)`` without its Python ``__init__`` (a plain
    dataclass of these three fields: a test checks it stays one). A store that evicts makes
    two of them, and the constructor's frame cost 1-3 us of its 3-6 us on the development
    VM, on the path of every ``await engine.store``."""
    event: Any = _new_object(_EVENT_CLASS)
    event.keys = keys
    event.medium = MEDIUM
    event.removed = removed
    return cast(OffloadingEvent, event)


def _store_output(
    keys_to_store: list[OffloadKey], spec: CPULoadStoreSpec, evicted_keys: list[OffloadKey]
) -> PrepareStoreOutput:
    """``PrepareStoreOutput(keys_to_store, spec, evicted_keys)`` without its Python
    ``__init__`` (a plain dataclass of these three fields: a test checks it stays one)."""
    output: Any = _new_object(_OUTPUT_CLASS)
    output.keys_to_store = keys_to_store
    output.store_spec = spec
    output.evicted_keys = evicted_keys
    return cast(PrepareStoreOutput, output)


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


def _check_keys(keys: Sequence[object]) -> None:
    """Raise InvalidKeyError for the first malformed key. Typed ``object``: compiled, a loop
    over ``OffloadKey`` items would raise a bare TypeError before this check named the key."""
    if type(keys) is list:  # the usual case: compiled, an indexed loop, no iterator object
        for key in keys:
            if type(key) is not bytes or len(key) <= 4:
                validate_offload_key(key)
        return
    for key in keys:
        if type(key) is not bytes or len(key) <= 4:
            validate_offload_key(key)


def _state_name(block: BlockStatus | None) -> str:
    if block is None:
        return "absent"
    return "being written" if block.ref_cnt < 0 else "idle" if block.ref_cnt == 0 else "being read"


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
        return CPUManagerStats(
            num_blocks=self._num_blocks,
            free=self._num_free(),
            writing=self._writing,
            idle=self._num_idle(),
            reading=self._reading,
            evictions=self._evictions,
            rejected_stores=self._rejected_stores,
            stored_blocks=self._stored_blocks,
            failed_store_blocks=self._failed_store_blocks,
            loaded_blocks=self._loaded_blocks,
            policy=self._policy_name,
            fenced=len(self._fenced),
            discarded_blocks=self._discarded_blocks,
            released_evictions=self._released_evictions,
            released=len(self._released),
            chosen_ahead=len(self._ahead),
            ahead_evictions=self._ahead_evictions,
            ahead_rescued=self._ahead_rescued,
        )

    # -- lookups and loads ---------------------------------------------------------------

    def lookup(self, key: Any, req_context: ReqContext | None = None) -> bool | None:
        # ``key: Any``: a malformed key must raise InvalidKeyError, also when compiled.
        block = self._blocks.get(key)
        if block is None:
            if self._ahead and key in self._ahead:  # chosen ahead: loadable until taken
                return True
            _check_keys((key,))
            return False
        return None if block.ref_cnt == -1 else True

    def prepare_load(
        self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None
    ) -> CPULoadStoreSpec:
        blocks = self._blocks_at_least(keys, 0, "load", "ready")
        if self._ahead:
            self._rescue(keys)
        newly_read = 0
        for block in blocks:
            if block.ref_cnt == 0:
                newly_read += 1
            block.ref_cnt += 1
        self._reading += newly_read
        # The blocks' own id objects: compiled, ``block_id`` would be boxed anew per block.
        return _cpu_spec([block.block_id_object for block in blocks])

    def _blocks_at_least(
        self, keys: Sequence[OffloadKey], min_ref_cnt: int, action: str, wanted: str
    ) -> list[BlockStatus]:
        """The blocks of ``keys``, checked before anything changes: BlockStateError unless
        every one is present with ``ref_cnt >= min_ref_cnt`` (0: ready, 1: being read)."""
        table = self._blocks
        blocks = []
        # Compiled: no cast to bytes before the check, and a list (the usual argument) is
        # walked by index, not through a generic iterator step per key.
        items: list[Any] = keys if isinstance(keys, list) else list(keys)
        for key in items:
            if type(key) is not bytes:
                _check_keys((key,))  # InvalidKeyError, unless a bytes subclass: then usable
            block = table.get(key)  # compiled: one C call; a bound ``get`` is a generic call
            if block is None and self._ahead:
                block = self._ahead.get(key)
            if block is None or block.ref_cnt < min_ref_cnt:
                # A malformed key anywhere is named before a state error (a bytes key found
                # in the table equals a stored, valid one, so only these need the full check).
                _check_keys(keys)
                raise BlockStateError(
                    f"cannot {action} key {key.hex()}: it is {_state_name(block)}, not {wanted}"
                )
            blocks.append(block)
        return blocks

    def touch(self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None) -> None:
        _check_keys(keys)
        if self._released:  # a released key asked for again was not dead after all
            released = self._released
            for key in keys:
                released.pop(key, None)
        if self._ahead:
            self._rescue(keys)
        self._policy.touch(keys)

    def complete_load(
        self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None
    ) -> None:
        blocks = self._blocks_at_least(keys, 1, "complete a load of", "being read")
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
            table = self._blocks
            for key, count in Counter(keys).items():
                ref_cnt = table[key].ref_cnt
                if count > ref_cnt:
                    raise BlockStateError(
                        f"cannot complete {count} loads of key {key.hex()}: only "
                        f"{ref_cnt} in flight"
                    )
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
        # The keys are checked in this loop (``_check_keys`` per key, as it goes): a bytes key
        # found in the table equals a stored key, so only the absent ones need their length
        # checked. Nothing changes before the loop ends, and the first malformed key raises.
        # Compiled: no cast to bytes before the check, and a list (the usual argument) is
        # walked by index, not through a generic iterator step per key.
        items: list[Any] = keys if isinstance(keys, list) else list(keys)
        for key in items:
            if type(key) is not bytes:
                _check_keys((key,))  # InvalidKeyError, unless a bytes subclass: then usable
            block = table.get(key)
            if block is None and self._ahead:
                block = self._ahead.get(key)
                if block is not None:
                    rescued.append(key)
            if block is None:
                if len(cast(bytes, key)) <= 4:
                    _check_keys((key,))
                keys_to_store.append(key)
                distinct.add(key)
            elif block.ref_cnt >= 0:
                present.append(block)
        if not keys_to_store:
            if rescued:
                self._rescue(rescued)
            return _store_output([], _cpu_spec([]), [])
        if len(distinct) != len(keys_to_store):
            keys_to_store = list(dict.fromkeys(keys_to_store))

        if rescued:  # chosen ahead, and asked for again: kept (nothing raises from here)
            self._rescue(rescued)
        needed = len(keys_to_store) - self._num_free()
        evicted_keys: list[OffloadKey] = []
        recycled: list[BlockStatus] = []  # this call's victims (two lists: no tuple each)
        if needed > 0 and not self._evict(needed, present, evicted_keys, recycled):
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
        return _store_output(keys_to_store, _cpu_spec(block_ids), evicted_keys)

    def _evict(
        self,
        needed: int,
        present: list[BlockStatus],
        evicted_keys: list[OffloadKey],
        recycled: list[BlockStatus],
    ) -> bool:
        """Evict ``needed`` idle blocks into ``evicted_keys`` and ``recycled``, their slots
        reset for a new store, published as one eviction event: blocks chosen ahead first,
        then the choice of :meth:`_choose`; ``present`` (ready blocks of the caller's keys)
        survive. False, with nothing changed, when too few blocks are evictable."""
        if self._num_idle() < needed:
            return False
        ahead = self._ahead
        taken = 0
        if ahead:
            # Oldest first, ahead of the policy's own victims (they were chosen first); out
            # of the chosen ones only once the policy found the rest.
            taken = min(needed, len(ahead))
            if taken == len(ahead):
                evicted_keys.extend(ahead)
                recycled.extend(ahead.values())
            else:
                for key, block in ahead.items():
                    if len(evicted_keys) == taken:
                        break
                    evicted_keys.append(key)
                    recycled.append(block)
            if taken < needed and not self._choose(needed - taken, present, evicted_keys, recycled):
                del evicted_keys[:]
                del recycled[:]
                return False
            if taken == len(ahead):
                ahead.clear()
            else:
                for index in range(taken):
                    del ahead[evicted_keys[index]]
            self._ahead_evictions += taken
        elif not self._choose(needed, present, evicted_keys, recycled):
            return False
        for block in recycled:
            block.ref_cnt = -1  # freed slots wait in the state a new store needs
        self._evictions += len(recycled)
        if self.events is not None:
            self.events.append(_event(evicted_keys, True))
        return True

    def _choose(
        self,
        needed: int,
        present: list[BlockStatus],
        evicted_keys: list[OffloadKey],
        recycled: list[BlockStatus],
    ) -> bool:
        """Take ``needed`` idle blocks out of the policy and the table (released ones first,
        then the policy's choice) into ``evicted_keys`` and ``recycled``, their state left
        as it was (idle); ``present`` survive. False, with nothing changed, when the policy
        cannot find that many."""
        # Every key of this call must survive the eviction. The ready ones are pinned for it
        # (blocks being read or written are never evicted anyway): the same effect as passing
        # the keys as ``protected``, without building a set of them.
        for block in present:
            block.ref_cnt += 1
        chosen = self._released_victims(needed) if self._released else []
        evicted = False
        first = len(evicted_keys)
        try:
            # The released victims are pinned while the policy picks the rest, so a refused
            # store changes nothing; they go only if it succeeds.
            evicted = len(chosen) == needed or self._policy.evict_blocks(
                needed - len(chosen), _NOTHING_PROTECTED, evicted_keys, recycled
            )
        finally:
            for block in present:
                block.ref_cnt -= 1
            for _key, block in chosen:
                block.ref_cnt -= 1
        if not evicted:
            return False
        if chosen:
            self._take_released(chosen, evicted_keys, recycled)
        if not self._shared_table:
            table = self._blocks
            for index in range(first, len(evicted_keys)):
                del table[evicted_keys[index]]
        return True

    def evict_ahead(self, free_target: int) -> int:
        """Choose now the idle blocks the next store would evict, so that ``free_target``
        slots are free or chosen (as many as are idle, when fewer); returns how many were
        chosen. They leave the policy but stay loadable (a lookup finds them, a load or a
        touch keeps them) until a store needs their slots: it takes them first, and only
        then are they evicted, published and counted as evictions.

        The engine calls it once a lone store's copy is on its way, so the next store's
        copy starts without the policy's choice in front of it (``docs/transfers.md``,
        thirtieth session). A block used meanwhile goes back where the policy had it
        (``CachePolicy.reinstate_blocks``). Nothing is chosen while released keys wait:
        those leave first at need, without the policy (and a rescued one would come back
        to a policy that never evicted it)."""
        if self._released or not self._policy.chooses_ahead:
            return 0
        ahead = self._ahead
        needed = min(free_target - self._num_free() - len(ahead), self._num_idle() - len(ahead))
        if needed <= 0:
            return 0
        keys: list[OffloadKey] = []
        blocks: list[BlockStatus] = []
        if not self._choose(needed, [], keys, blocks):
            return 0
        for index in range(len(keys)):
            ahead[keys[index]] = blocks[index]
        return len(keys)

    def _rescue(self, keys: Sequence[OffloadKey]) -> None:
        """Give the blocks of ``keys`` chosen ahead back to the table and to the policy,
        which puts them where they were (``CachePolicy.reinstate_blocks``), in the order
        chosen; the caller's touch, if any, follows."""
        ahead = self._ahead
        back_keys: list[OffloadKey] = []
        for key in keys:
            if key in ahead:
                back_keys.append(key)
        if not back_keys:
            return
        if len(back_keys) > 1:  # the order they were chosen in (``ahead`` keeps it)
            wanted = set(back_keys)
            back_keys = [key for key in ahead if key in wanted]
        back_blocks: list[BlockStatus] = []
        for key in back_keys:
            back_blocks.append(ahead.pop(key))
        if not self._shared_table:
            table = self._blocks
            for index in range(len(back_keys)):
                table[back_keys[index]] = back_blocks[index]
        self._policy.reinstate_blocks(back_keys, back_blocks)
        self._ahead_rescued += len(back_keys)

    def complete_store(
        self,
        keys: Sequence[OffloadKey],
        req_context: ReqContext | None = None,
        success: bool = True,
    ) -> None:
        _check_keys(keys)  # before any change: a bad key in the middle must change nothing
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
                    events.append(_event(stored, False))
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

    def _forget_chosen(self, key: OffloadKey) -> BlockStatus | None:
        """:meth:`_forget` for a key chosen ahead (already out of the policy, the table and
        the released marks): its block, slot left as a new store needs it, or None when
        ``key`` was not chosen. The caller frees or fences the slot."""
        block = self._ahead.pop(key, None)
        if block is not None:
            block.ref_cnt = -1
        return block

    def release(self, keys: Sequence[OffloadKey]) -> int:
        """Mark ``keys`` as probably dead (a closed session's own blocks): when room is
        needed they are evicted first, oldest release first, before the policy chooses; a
        key used again (``touch``) meanwhile is kept as the policy would. Returns how many
        present keys were marked. The soft form of :meth:`discard`: nothing leaves until
        its slot is wanted, so a wrong hint costs nothing while the cache has room.

        Blocks chosen ahead go back to the policy first (``evict_ahead`` chooses none while
        released keys wait): at need the released keys leave before the policy's choice."""
        _check_keys(keys)
        table = self._blocks
        released = self._released
        ahead = self._ahead
        fresh: dict[OffloadKey, None] = {}
        for key in keys:
            if (key in table or key in ahead) and key not in released:
                fresh[key] = None
        if fresh and ahead:  # a release that marks nothing leaves the choice as it is
            self._rescue(list(ahead))
        released.update(fresh)
        return len(fresh)

    def _released_victims(self, needed: int) -> list[tuple[OffloadKey, BlockStatus]]:
        """Up to ``needed`` idle released blocks, oldest release first, pinned (``ref_cnt``
        + 1) until the caller knows the store goes ahead. With fewer than ``needed``, every
        idle released block is pinned, so the policy, asked for the rest, takes none."""
        table = self._blocks
        chosen: list[tuple[OffloadKey, BlockStatus]] = []
        for key in self._released:
            if len(chosen) == needed:
                break
            block = table.get(key)
            if block is not None and block.ref_cnt == 0:  # idle: not read, not pinned here
                block.ref_cnt = 1
                chosen.append((key, block))
        return chosen

    def _take_released(
        self,
        chosen: list[tuple[OffloadKey, BlockStatus]],
        evicted_keys: list[OffloadKey],
        recycled: list[BlockStatus],
    ) -> None:
        """Evict the released victims of a store that goes ahead (idle again by now): out of
        the policy and the released list; the caller handles them as the policy's victims."""
        remove = self._policy.remove
        released = self._released
        for key, block in chosen:
            remove(key)  # the caller drops the evicted keys from its own table
            del released[key]
            evicted_keys.append(key)
            recycled.append(block)
        self._released_evictions += len(chosen)

    def discard(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """Free the idle blocks of ``keys`` now: the caller knows nobody will ask for them
        again (a closed session's own blocks). Returns the keys dropped, published as one
        eviction event; absent keys and blocks being written or read are left as they are.

        The policy cannot know which blocks are dead, and the lab's dead-block oracle
        (``docs/policy-lab.md``) is worth more than any policy on the conversation trace: a
        hint from the serving engine is the one source of that knowledge.
        """
        _check_keys(keys)
        table = self._blocks
        free_list = self._free_list
        dropped: list[OffloadKey] = []
        ahead = self._ahead
        for key in keys:
            block = table.get(key)
            if block is None and ahead:
                block = self._forget_chosen(key)
                if block is not None:
                    free_list.append(block)
                    dropped.append(key)
                continue
            if block is None or block.ref_cnt != 0:
                continue
            self._forget(key, block)
            free_list.append(block)
            dropped.append(key)
        self._discarded_blocks += len(dropped)
        if dropped and self.events is not None:
            self.events.append(_event(dropped, True))
        return dropped

    # -- events and lifecycle ------------------------------------------------------------

    def take_events(self) -> Iterator[OffloadingEvent]:
        if self.events is None:
            return
        events, self.events = self.events, []
        yield from events

    def fence(self, keys: Sequence[OffloadKey]) -> list[int]:
        """Drop ``keys`` (in any state) but keep their slots from reuse; returns the slot ids.

        For slots a client outside this process may still write (an expired or reset
        sidecar store lease): handing such a slot to another key would let the late bytes
        land in that key's ready block. :meth:`release_fenced` makes them free again.
        """
        _check_keys(keys)
        table = self._blocks
        fenced: list[int] = []
        ahead = self._ahead
        for key in keys:
            block = table.get(key)
            if block is None and ahead:
                block = self._forget_chosen(key)
                if block is not None:
                    self._fenced[block.block_id] = block
                    fenced.append(block.block_id)
                continue
            if block is None:
                continue
            if block.ref_cnt == -1:
                self._writing -= 1
                self._failed_store_blocks += 1
            elif block.ref_cnt > 0:
                self._reading -= 1
            self._forget(key, block)
            self._fenced[block.block_id] = block
            fenced.append(block.block_id)
        return fenced

    def release_fenced(self, block_ids: Sequence[int]) -> None:
        """Make fenced slots free again (unknown ids are ignored: a reset may have freed them)."""
        for block_id in block_ids:
            block = self._fenced.pop(block_id, None)
            if block is not None:
                self._free_list.append(block)

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
