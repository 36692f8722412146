"""A read-only walk over a FIFO that can also see keys appended during the walk.

Eviction must be atomic (return None having changed nothing), yet FIFO-with-reinsertion
policies move keys while they search. They plan on this view instead: it yields the queue's
keys front to back without touching it, then the keys the plan re-appended, in order. The
plan is then applied to the real queue only once all victims were found.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from kvcache_offload.contracts.offload_key import OffloadKey

__all__ = ["VirtualFifo"]


class VirtualFifo:
    """Front-to-back walk over ``keys`` followed by what :meth:`append` adds."""

    __slots__ = ("_appended", "_it")

    def __init__(self, keys: Iterable[OffloadKey]) -> None:
        self._it: Iterator[OffloadKey] | None = iter(keys)
        self._appended: deque[OffloadKey] = deque()

    def append(self, key: OffloadKey) -> None:
        self._appended.append(key)

    def pop(self) -> OffloadKey | None:
        """The next key of the walk, or None when the queue and the appended keys are done."""
        it = self._it
        if it is not None:
            for key in it:  # compiled, a loop reads an iterator cheaper than ``next``
                return key
            self._it = None
        if self._appended:
            return self._appended.popleft()
        return None
