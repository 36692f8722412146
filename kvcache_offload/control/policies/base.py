"""The eviction-policy contract: a policy owns both block storage and the replacement choice.

Storage and decision cannot be split cleanly (ARC's ghost lists, segmented queues), so one
object does both. Policies are pure Python and know nothing of torch or transfers; they only
see each block's ``ref_cnt``: -1 being written, 0 idle (the only evictable state), >0 being
read by that many loads. A block also carries two ints for the policy holding it (``mark``,
``second_mark``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from typing import ClassVar

from mypy_extensions import mypyc_attr

from kvcache_offload.contracts.offload_key import OffloadKey

__all__ = [
    "BlockStatus",
    "Blocks",
    "CachePolicy",
    "Keys",
    "ListEvictionPolicy",
    "Protected",
    "Victims",
    "append_victims",
    "victims_from",
]


class BlockStatus:
    """State of one CPU slot: its id and its reference count (-1 = being written), plus a
    small int the policy holding the block keeps there (:attr:`mark`, :attr:`second_mark`)."""

    __slots__ = ("block_id", "block_id_object", "key_crc", "mark", "ref_cnt", "second_mark")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        # The same id as one int object, made once per slot: compiled, ``block_id`` is a
        # native int, and every read of it into a list (a spec's ids) would allocate a new one.
        self.block_id_object: object = block_id
        self.ref_cnt = -1
        # The policy's own per-block state (S3-FIFO's use count, SIEVE's visited bit), set
        # when it enqueues the block; the manager never reads it. Compiled, an attribute of
        # the block already in hand costs a few instructions where a per-key dict costs a
        # hash-table probe on every read, write and delete.
        self.mark = 0
        # A second int of the policy's own (LRU-2's second-last access of a used block), with
        # the same rules as ``mark``: the policy sets it before it reads it, since the
        # manager hands a block to another key (and policy) without resetting it.
        self.second_mark = 0
        # The CRC-32 of the block's key, or -1: a policy that samples keys by their CRC
        # keeps it here once computed (compiled, a ``zlib.crc32`` call costs hundreds of
        # instructions, a cached hit's a field read). Whoever reads it must reset it when
        # a key takes the block (the manager reuses blocks for other keys).
        self.key_crc = -1

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0

    def __repr__(self) -> str:
        return f"BlockStatus(block_id={self.block_id}, ref_cnt={self.ref_cnt})"


Keys = list[OffloadKey]
"""Victims' keys, appended to by ``evict_blocks`` (the manager's own list)."""
Blocks = list[BlockStatus]
"""Victims' blocks, co-indexed with :data:`Keys`."""
Protected = Collection[OffloadKey]
"""Keys that must survive an eviction."""
Victims = list[tuple[OffloadKey, BlockStatus]]
"""``evict``'s answer: (key, block) pairs."""


def victims_from(
    select: Callable[[int, Protected, Keys, Blocks], bool], n: int, protected: Protected
) -> Victims | None:
    """An eviction's pair form from its list form ``select`` (``evict`` from an
    ``evict_blocks``-like method; :func:`append_victims` goes the other way): None when
    ``select`` cannot take ``n``."""
    keys: list[OffloadKey] = []
    blocks: list[BlockStatus] = []
    if not select(n, protected, keys, blocks):
        return None
    return list(zip(keys, blocks, strict=True))


@mypyc_attr(allow_interpreted_subclasses=True)
class CachePolicy(ABC):
    """Stores offloaded blocks and decides which idle ones to evict.

    Rules every policy must honour (the manager and the stateful tests rely on them):
    ``evict`` returns exactly ``n`` victims that are idle (``ref_cnt == 0``) and not in
    ``protected``, or ``None`` having changed nothing; its cost is proportional to the victims
    plus the pinned/protected blocks it skips, never to the cache size.
    """

    name: ClassVar[str] = ""
    chooses_ahead: ClassVar[bool] = False
    """Whether the manager may choose this policy's victims ahead of a store, behind the
    previous store's copy (:meth:`CPUOffloadingManager.evict_ahead`). Only where that
    choice is the one it would make at need: the previous store's blocks are still being
    written then, so none of them can be chosen, and a policy that may evict a block just
    stored before older ones (a probation queue for blocks never used, ARC's T1) would
    take older blocks instead. Replayed with choices ahead after every store, the default
    policy lost 13 % of its block hits on the shipped sample and ARC 5 % on a Mooncake
    trace (docs/transfers.md, "Victims chosen ahead (LRU only)"). LRU stores a new block as its most
    recent, and a use only moves a block away from eviction: it chooses ahead. A subclass
    inherits the flag: one that changes where a new block goes, or what a use does, sets it
    False."""

    def __init__(self, cache_capacity: int) -> None:
        # Concrete (not abstract) so compiled subclasses can chain to it.
        self.cache_capacity = cache_capacity

    @abstractmethod
    def get(self, key: OffloadKey) -> BlockStatus | None:
        """The block stored under ``key`` or None; no side effects."""

    @abstractmethod
    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        """Add a newly allocated block (``key`` is not present)."""

    def insert_many(self, pairs: Sequence[tuple[OffloadKey, BlockStatus]]) -> None:
        """Insert several new blocks in order; override when a batch is cheaper."""
        for key, block in pairs:
            self.insert(key, block)

    def insert_blocks(self, keys: list[OffloadKey], blocks: list[BlockStatus]) -> None:
        """Insert ``blocks[i]`` under ``keys[i]``, in order: the manager's call for a store.

        Same as :meth:`insert_many` of the pairs (the default builds them), for policies that
        can take the two lists as they are: compiled, a tuple per stored block costs an
        allocation, and a policy overriding ``insert`` or ``insert_many`` is still obeyed.
        """
        self.insert_many(list(zip(keys, blocks, strict=True)))

    def block_table(self) -> dict[OffloadKey, BlockStatus] | None:
        """The policy's own key -> block dict holding exactly its blocks, if it has one.

        A manager may then use it as its lookup table instead of keeping a copy; it never
        mutates it, so it must stay the same object for the policy's lifetime (``clear``
        empties it in place). None (the default) makes the manager keep its own table.
        """
        return None

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Drop a block whose store failed (``key`` is present)."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Mark keys used, processed in reverse so the first key ends up most recent."""

    @abstractmethod
    def evict(self, n: int, protected: Protected) -> Victims | None:
        """Remove exactly ``n`` idle, unprotected blocks, or return None changing nothing."""

    def evict_blocks(self, n: int, protected: Protected, keys: Keys, blocks: Blocks) -> bool:
        """:meth:`evict`, the victims' keys and blocks appended to ``keys`` and ``blocks``
        (the manager's call): False, changing nothing and appending nothing, when it cannot.

        The default splits :meth:`evict`'s pairs; a policy that can fill the two lists as it
        goes overrides it (compiled, a tuple per victim costs an allocation) and still
        defers to an ``evict`` a subclass overrides.
        """
        return append_victims(self.evict(n, protected), keys, blocks)

    def reinstate_blocks(self, keys: list[OffloadKey], blocks: list[BlockStatus]) -> None:
        """Take back blocks that this policy's evictions chose, in the order chosen, whose
        slots were not reused meanwhile: the manager chooses a store's victims ahead of it
        (:meth:`CPUOffloadingManager.evict_ahead`) and a block used before that store comes
        back. A policy puts each where it was, with what it knew of it, and forgets the
        ghost it became, so that its later choices are those it would have made had the
        block never been chosen.

        The default inserts them as newly stored blocks. For a policy that learns from
        stores or ghosts that counts a store that never happened and loses the block's
        history; only policies that choose ahead (:attr:`chooses_ahead`) are ever asked,
        and LRU, the one shipped, overrides it to put them back at its least-recent end.
        """
        self.insert_blocks(keys, blocks)

    @abstractmethod
    def clear(self) -> None:
        """Drop every block and all adaptive state."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of blocks stored (any state)."""

    def debug_state(self) -> dict[str, object]:
        """Policy-specific internals for tests and introspection (sizes, targets)."""
        return {"size": len(self)}


@mypyc_attr(allow_interpreted_subclasses=True)
class ListEvictionPolicy(CachePolicy):
    """A policy whose one eviction walk appends to the manager's two lists
    (:meth:`_evict_into`): ``evict_blocks`` is that walk, ``evict`` its pairs. A subclass
    that overrides ``evict`` is still obeyed by ``evict_blocks``."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._plain_evict = type(self).evict is ListEvictionPolicy.evict

    def evict(self, n: int, protected: Protected) -> Victims | None:
        return victims_from(self._evict_into, n, protected)

    def evict_blocks(self, n: int, protected: Protected, keys: Keys, blocks: Blocks) -> bool:
        if not self._plain_evict:
            return super().evict_blocks(n, protected, keys, blocks)
        return self._evict_into(n, protected, keys, blocks)

    @abstractmethod
    def _evict_into(self, n: int, protected: Protected, keys: Keys, blocks: Blocks) -> bool:
        """The eviction: ``n`` victims appended to the two lists (none when ``n <= 0``), or
        False having appended and changed nothing."""


def append_victims(
    victims: list[tuple[OffloadKey, BlockStatus]] | None,
    keys: list[OffloadKey],
    blocks: list[BlockStatus],
) -> bool:
    """Append ``victims``' keys and blocks to the two lists (the list form of an eviction,
    from its pair form); False, appending nothing, when there are none to take."""
    if victims is None:
        return False
    for key, block in victims:
        keys.append(key)
        blocks.append(block)
    return True
