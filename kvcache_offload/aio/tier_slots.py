"""PendingSlots: which CPU slot still holds the bytes of each key whose tier write is pending.

A tier write reads its key's bytes from the key's CPU slot when the writer reaches it, long
after the store completed. Meanwhile the key may leave the slot (discard, eviction, a failed
store, an expired lease, a reset) and the slot may be handed to another key, whose bytes then
overwrite it. This is the slot fence that keeps such a write from saving the other key's
bytes, as one mechanism rather than a check in each path that frees a slot:

* A slot gets new bytes only after the manager hands it to a store, and every hand-out is
  reported here (:meth:`handed_out`). It bumps the slot's generation and drops the pending
  write of the key the slot held before.
* A completed store (:meth:`stored`) records its key's slot with the generation of its
  hand-out. A reader copies the bytes only while :meth:`holds` says that slot and generation
  are still the key's, and checks again after the copy, which runs in a worker thread while
  the next store may already be writing the slot.

A freed slot that nobody took yet still holds its old key's bytes, so that key's write stands.
All methods run on the event-loop thread.
"""

from __future__ import annotations

from kvcache_offload.contracts.offload_key import OffloadKey

__all__ = ["Held", "PendingSlots"]

Held = tuple[int, int]
"""A CPU slot and its generation when it was handed to the store of a key."""


class PendingSlots:
    """The slot fence of the engine's tier writes; see the module docstring."""

    def __init__(self) -> None:
        self._held: dict[OffloadKey, Held] = {}
        """Slot of each stored key whose bytes have not been handed to the tiers yet."""
        self._preparing: dict[OffloadKey, Held] = {}
        """Slot of each key whose store is prepared but not completed."""
        self._generation: dict[int, int] = {}
        """How many times each slot was handed to a store."""
        self._owner: dict[int, OffloadKey] = {}
        """The key whose pending bytes each slot in ``_held`` holds."""

    def __bool__(self) -> bool:
        return bool(self._held)

    def handed_out(self, key: OffloadKey, slot: int) -> None:
        """The manager gave ``slot`` to a store of ``key``: the slot's old key loses it."""
        gen = self._generation.get(slot, 0) + 1
        self._generation[slot] = gen
        old = self._owner.pop(slot, None)
        if old is not None and self._held.get(old, (-1, -1))[0] == slot:
            del self._held[old]
        self._preparing[key] = (slot, gen)

    def failed(self, key: OffloadKey) -> None:
        self._preparing.pop(key, None)

    def stored(self, key: OffloadKey) -> bool:
        """``key``'s store completed: its slot now holds its bytes. False when it was not
        prepared here (or its slot changed hands since, which a store in flight prevents)."""
        held = self._preparing.pop(key, None)
        if held is None or self._generation.get(held[0]) != held[1]:
            return False
        self.forget(key)
        self._held[key] = held
        self._owner[held[0]] = key
        return True

    def unprepare(self, key: OffloadKey) -> None:
        """Forget a prepared store whose bytes will not be written below (a promotion)."""
        self._preparing.pop(key, None)

    def get(self, key: OffloadKey) -> Held | None:
        """``key``'s slot and generation if its slot still holds its bytes, else None."""
        held = self._held.get(key)
        return held if held is not None and self.holds(key, held) else None

    def holds(self, key: OffloadKey, held: Held) -> bool:
        """True while ``held`` (from :meth:`get`) is still ``key``'s slot and generation."""
        return self._held.get(key) == held and self._generation.get(held[0]) == held[1]

    def forget(self, key: OffloadKey) -> None:
        """``key``'s bytes were handed to the tiers, or its write was dropped."""
        held = self._held.pop(key, None)
        if held is not None and self._owner.get(held[0]) == key:
            del self._owner[held[0]]

    def clear(self) -> None:
        """A reset: no pending write has a slot any more (generations go on counting)."""
        self._held.clear()
        self._owner.clear()
        self._preparing.clear()
