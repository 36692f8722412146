"""Adaptive Replacement Cache with vLLM's touch-driven adaptation.

T1 holds blocks seen once, T2 blocks seen again; ghost lists B1/B2 remember recently evicted
keys and steer the target size of T1. Two deliberate fixes over vLLM's classic version:
eviction is one monotonic pass over each list (not a rescan from the head per victim), and
when T2 has no evictable block left eviction falls back to T1 instead of failing.

Storage: one dict maps every key of the four lists to its node, and each list is an
intrusive doubly-linked ring of nodes. A key is found with one probe whichever list holds it,
and moving it between lists (promotion, eviction to a ghost list) is pointer work, not dict
work: about half the hash operations of four ordered dicts. The module is compiled with mypyc
(``kvcache_offload/_compiled.py``), where node fields are plain struct fields.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Final

from mypy_extensions import mypyc_attr

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies.base import (
    Blocks,
    BlockStatus,
    Keys,
    ListEvictionPolicy,
    Protected,
)

__all__ = ["B1", "B2", "T1", "T2", "ARCCachePolicy"]

T1: Final = 0
T2: Final = 1
B1: Final = 2
B2: Final = 3

_MAX_SPARE_NODES: Final = 4096


@mypyc_attr(acyclic=True)
class _Node:
    """One key in one of the four lists; ``block`` is None while it is a ghost.

    Compiled, nodes stay out of the cyclic garbage collector (``acyclic``): a cache of a
    million blocks would otherwise add a million objects to every full collection. The
    rings are the only cycles, so they are cut by hand: a node leaving a ring is detached,
    and a policy cuts its rings when cleared or freed.
    """

    def __init__(self, key: OffloadKey, block: BlockStatus | None, where: int) -> None:
        self.key = key
        self.block = block
        self.where = where
        self.prev: _Node = self
        self.next: _Node = self


_DETACHED: Final = _Node(OffloadKey(b""), None, -1)
"""What a node outside any ring points to (instead of its former neighbours)."""


class _Ring:
    """A list of nodes, least recent first, around a sentinel."""

    def __init__(self) -> None:
        self.head = _Node(OffloadKey(b""), None, -1)
        self.size = 0

    def append(self, node: _Node) -> None:
        """Insert at the most-recent end."""
        head = self.head
        last = head.prev
        node.prev = last
        node.next = head
        last.next = node
        head.prev = node
        self.size += 1

    def unlink(self, node: _Node) -> None:
        node.prev.next = node.next
        node.next.prev = node.prev
        node.prev = _DETACHED
        node.next = _DETACHED
        self.size -= 1

    def move_to_end(self, node: _Node) -> None:
        head = self.head
        if node.next is head:
            return
        node.prev.next = node.next
        node.next.prev = node.prev
        last = head.prev
        node.prev = last
        node.next = head
        last.next = node
        head.prev = node

    def keys(self) -> list[OffloadKey]:
        out: list[OffloadKey] = []
        head = self.head
        node = head.next
        while node is not head:
            out.append(node.key)
            node = node.next
        return out

    def cut(self) -> None:
        """Detach every node and the sentinel: no reference cycle is left."""
        head = self.head
        node = head.next
        while node is not head:
            following = node.next
            node.prev = _DETACHED
            node.next = _DETACHED
            node = following
        head.prev = _DETACHED
        head.next = _DETACHED
        self.size = 0

    def clear(self) -> None:
        self.cut()
        self.head.prev = self.head
        self.head.next = self.head


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled, still subclassable
class ARCCachePolicy(ListEvictionPolicy):
    """ARC as vLLM drives it: adaptation on ``touch`` of ghost keys, new blocks enter T1.

    ``t1``, ``t2``, ``b1`` and ``b2`` are snapshots of the lists' keys, least recent first
    (introspection and tests); ``scanned`` counts nodes eviction has looked at, to show
    eviction stays proportional to victims plus the pinned or protected blocks it skips.
    """

    name = "arc"

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.target_t1_size = 0.0
        self.scanned = 0
        self._nodes: dict[OffloadKey, _Node] = {}
        # Nodes of forgotten ghosts, reused by insert: steady-state stores allocate nothing.
        self._spare: list[_Node] = []
        self._t1 = _Ring()
        self._t2 = _Ring()
        self._b1 = _Ring()
        self._b2 = _Ring()

    # -- introspection ---------------------------------------------------------------------

    def keys_in(self, where: int) -> list[OffloadKey]:
        """The keys of one list (``T1``, ``T2``, ``B1`` or ``B2``), least recent first."""
        return self._ring(where).keys()

    def _ring(self, where: int) -> _Ring:
        if where == T1:
            return self._t1
        if where == T2:
            return self._t2
        return self._b1 if where == B1 else self._b2

    # -- the policy ------------------------------------------------------------------------

    def get(self, key: OffloadKey) -> BlockStatus | None:
        node = self._nodes.get(key)
        if node is None or node.where >= B1:
            return None
        return node.block

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        spare = self._spare
        fresh = spare.pop() if spare else _Node(key, block, T1)
        node = self._nodes.setdefault(key, fresh)  # one probe, ghost or not
        if node is fresh:
            node.key = key
            node.block = block
            node.where = T1
        else:  # a ghost comes back: it leaves its ghost list
            spare.append(fresh)
            self._ring(node.where).unlink(node)
            node.block = block
            node.where = T1
        self._t1.append(node)

    def insert_many(self, pairs: Sequence[tuple[OffloadKey, BlockStatus]]) -> None:
        for key, block in pairs:
            self.insert(key, block)

    def insert_blocks(self, keys: list[OffloadKey], blocks: list[BlockStatus]) -> None:
        if type(self).insert_many is not ARCCachePolicy.insert_many:
            super().insert_blocks(keys, blocks)  # a subclass's ``insert_many`` sees the pairs
            return
        for index in range(len(keys)):
            self.insert(keys[index], blocks[index])

    def remove(self, key: OffloadKey) -> None:
        node = self._nodes.pop(key)
        self._ring(node.where).unlink(node)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        nodes = self._nodes
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        capacity = float(self.cache_capacity)
        for i in range(len(keys) - 1, -1, -1):
            node = nodes.get(keys[i])
            if node is None:
                continue
            where = node.where
            if where == T1:
                block = node.block
                if block is not None and block.ref_cnt == -1:
                    # A store just prepared is not a second access.
                    t1.move_to_end(node)
                else:
                    t1.unlink(node)
                    node.where = T2
                    t2.append(node)
            elif where == T2:
                t2.move_to_end(node)
            elif where == B1:
                delta = max(1.0, b2.size / b1.size)
                self.target_t1_size = min(self.target_t1_size + delta, capacity)
                b1.move_to_end(node)
            else:
                delta = max(1.0, b1.size / b2.size)
                self.target_t1_size = max(self.target_t1_size - delta, 0.0)
                b2.move_to_end(node)

    def _take(
        self,
        ring: _Ring,
        start: _Node,
        count: int,
        protected: Collection[OffloadKey],
        out: list[_Node],
    ) -> _Node:
        """Append up to ``count`` idle, unprotected nodes from ``start`` on to ``out``; return
        the node after the last one looked at, so a later call continues the same pass."""
        head = ring.head
        node = start
        taken = 0
        scanned = 0
        while taken < count and node is not head:
            scanned += 1
            block = node.block
            if block is not None and block.ref_cnt == 0 and node.key not in protected:
                out.append(node)
                taken += 1
            node = node.next
        self.scanned += scanned
        return node

    def _evict_into(self, n: int, protected: Protected, keys: Keys, blocks: Blocks) -> bool:
        """:meth:`evict_blocks` itself: the victims appended to the two lists, or False."""
        if n <= 0:
            return True
        t1, t2 = self._t1, self._t2
        # Victim i comes from T1 while |T1| - (T1 victims so far) >= int(p): that is, the
        # first len(T1) - int(p) + 1 victims (capped to n), the rest from T2; when T2 has no
        # evictable block left, from T1 after all (vLLM #55461). Each list is walked once.
        from_t1_target = t1.size - int(self.target_t1_size) + 1
        from_t1_target = 0 if from_t1_target < 0 else min(from_t1_target, n)
        from_t1: list[_Node] = []
        t1_next = self._take(t1, t1.head.next, from_t1_target, protected, from_t1)
        from_t2: list[_Node] = []
        self._take(t2, t2.head.next, n - len(from_t1), protected, from_t2)
        missing = n - len(from_t1) - len(from_t2)
        fallback: list[_Node] = []
        if missing:
            self._take(t1, t1_next, missing, protected, fallback)
            if len(fallback) < missing:
                return False
        b1, b2 = self._b1, self._b2
        for group, source, ghosts, where in (
            (from_t1, t1, b1, B1),
            (from_t2, t2, b2, B2),
            (fallback, t1, b1, B1),
        ):
            for node in group:
                block = node.block
                assert block is not None
                keys.append(node.key)
                blocks.append(block)
                source.unlink(node)
                node.block = None
                node.where = where
                ghosts.append(node)
        self._trim(b1)
        self._trim(b2)
        return True

    def _trim(self, ghosts: _Ring) -> None:
        """Forget the least recent ghosts beyond the cache capacity."""
        nodes = self._nodes
        head = ghosts.head
        spare = self._spare
        while ghosts.size > self.cache_capacity:
            node = head.next
            ghosts.unlink(node)
            del nodes[node.key]
            if len(spare) < _MAX_SPARE_NODES:
                node.key = _DETACHED.key
                spare.append(node)

    def clear(self) -> None:
        self._nodes.clear()
        self._spare.clear()
        for ring in (self._t1, self._t2, self._b1, self._b2):
            ring.clear()
        self.target_t1_size = 0.0

    def __del__(self) -> None:
        for ring in (self._t1, self._t2, self._b1, self._b2):
            ring.cut()

    def __len__(self) -> int:
        return self._t1.size + self._t2.size

    def debug_state(self) -> dict[str, object]:
        return {
            "size": len(self),
            "t1": self._t1.size,
            "t2": self._t2.size,
            "b1": self._b1.size,
            "b2": self._b2.size,
            "target_t1_size": self.target_t1_size,
        }
