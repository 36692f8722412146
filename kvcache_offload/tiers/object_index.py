"""ObjectIndex: what the object tier believes its bucket holds, so a lookup costs no request.

An object store answers "does this exist" only with a request per key (``HEAD``), tens of
milliseconds on a cloud store. The tier therefore keeps, in memory:

* the *held* keys with each object's size, oldest first (the order of a listing's
  ``last_modified``, then of this instance's writes; a read moves a key to the end). A budget
  evicts from the front.
* the *absent* keys: keys a ``HEAD`` just found missing, remembered for ``absent_ttl_s`` so a
  lookup of the same new prefix again does not ask again. Bounded, oldest forgotten first.

It is fed by this instance's writes, by ``HEAD`` answers on a miss, and by a listing of the
fingerprint's prefix at start and at intervals (which also adds other instances' writes and
drops what lifecycle rules or other instances deleted). Everything here runs on the event loop.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable

from kvcache_offload.contracts.offload_key import OffloadKey

__all__ = ["ObjectIndex"]

_ABSENT_MAX = 65_536


class ObjectIndex:
    """Held keys (size, age order) and recently absent keys; see the module docstring."""

    def __init__(self, absent_ttl_s: float = 5.0) -> None:
        self.absent_ttl_s = absent_ttl_s
        self._held: OrderedDict[OffloadKey, int] = OrderedDict()
        self._absent: OrderedDict[OffloadKey, float] = OrderedDict()
        self._touched: set[OffloadKey] = set()
        """Keys added or removed since the listing in progress began (it must not undo them)."""
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def unknown(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """Keys neither held nor recently found absent: a ``HEAD`` may tell."""
        now = time.monotonic()
        held, absent = self._held, self._absent
        out = []
        for key in keys:
            if key in held:
                continue
            seen = absent.get(key)
            if seen is not None and now - seen < self.absent_ttl_s:
                continue
            out.append(key)
        return out

    def add(self, key: OffloadKey, size: int) -> None:
        """``key`` is held with ``size`` bytes (newest)."""
        old = self._held.pop(key, None)
        if old is not None:
            self.used_bytes -= old
        self._held[key] = size
        self.used_bytes += size
        self._absent.pop(key, None)
        self._touched.add(key)

    def touch(self, key: OffloadKey) -> None:
        """A read: the key moves to the end (last evicted)."""
        if key in self._held:
            self._held.move_to_end(key)

    def forget(self, key: OffloadKey, *, absent: bool = True) -> bool:
        """``key`` is gone; remembered as absent unless told otherwise. True if it was held."""
        size = self._held.pop(key, None)
        self._touched.add(key)
        if absent:
            self._absent[key] = time.monotonic()
            self._absent.move_to_end(key)
            while len(self._absent) > _ABSENT_MAX:
                self._absent.popitem(last=False)
        if size is None:
            return False
        self.used_bytes -= size
        return True

    def oldest_over(self, budget: int, incoming: int = 0) -> list[OffloadKey]:
        """Forget the oldest keys until ``incoming`` more bytes fit ``budget``; returns them."""
        victims = []
        while self._held and self.used_bytes + incoming > budget:
            key, size = self._held.popitem(last=False)
            self.used_bytes -= size
            self._touched.add(key)
            victims.append(key)
        return victims

    def begin_listing(self) -> None:
        """A listing starts: changes from now on win over what it reports."""
        self._touched.clear()

    def apply_listing(self, listed: list[tuple[OffloadKey, int, float]]) -> None:
        """Replace the held keys with a listing's ``(key, size, last_modified)``, oldest first,
        keeping what changed since :meth:`begin_listing` and this instance's read order for
        keys it already held."""
        touched = self._touched
        listed_keys = {key for key, _, _ in listed}
        fresh: OrderedDict[OffloadKey, int] = OrderedDict()
        for key, size, _ in sorted(listed, key=lambda item: item[2]):
            if key not in touched and key not in self._held:
                fresh[key] = size  # another instance's, or this one's before a restart
        for key, size in self._held.items():
            if key in listed_keys or key in touched:
                fresh[key] = size  # else deleted elsewhere (lifecycle rule, another budget)
        self._held = fresh
        self.used_bytes = sum(fresh.values())
        for key in fresh:
            self._absent.pop(key, None)
