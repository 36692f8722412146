"""PendingSlots, the slot fence of tier writes: whatever order slots are handed out, written,
completed, failed and reset in, a key it reports as pending has its own latest bytes in the
slot it names."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache_offload.aio.tier_slots import PendingSlots

KEYS = st.sampled_from("abcdef")
SLOTS = st.integers(0, 3)


class SlotFence(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.fence = PendingSlots()
        self.memory: dict[int, tuple[str, int]] = {}
        """What each slot holds: (key, version of its bytes)."""
        self.writing: dict[str, tuple[int, int]] = {}
        """Stores in flight: key -> (slot, version being written)."""
        self.latest: dict[str, int] = {}
        """The version of each key's last completed store."""
        self.version = 0

    @precondition(lambda self: len(self.writing) < 4)
    @rule(key=KEYS, slot=SLOTS)
    def prepare(self, key: str, slot: int) -> None:
        """The manager hands ``slot`` to a store of ``key`` (whatever freed it before)."""
        if key in self.writing or any(s == slot for s, _ in self.writing.values()):
            return  # a key or slot being written is never handed out
        self.version += 1
        self.fence.handed_out(key, slot)  # type: ignore[arg-type]
        self.memory[slot] = ("?", -1)  # the copy starts at once: the old bytes are gone
        self.writing[key] = (slot, self.version)

    @precondition(lambda self: bool(self.writing))
    @rule(data=st.data(), ok=st.booleans())
    def complete(self, data: st.DataObject, ok: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.writing)))
        slot, version = self.writing.pop(key)
        if ok:
            self.memory[slot] = (key, version)
            self.latest[key] = version
            self.fence.stored(key)  # type: ignore[arg-type]
        else:
            self.fence.failed(key)  # type: ignore[arg-type]

    @rule(key=KEYS)
    def handed_to_the_tiers(self, key: str) -> None:
        self.fence.forget(key)  # type: ignore[arg-type]

    @precondition(lambda self: not self.writing)
    @rule()
    def reset(self) -> None:
        self.fence.clear()
        self.memory.clear()
        self.latest.clear()

    @invariant()
    def pending_slots_hold_their_keys_latest_bytes(self) -> None:
        for key in "abcdef":
            held = self.fence.get(key)  # type: ignore[arg-type]
            if held is not None:
                assert self.memory.get(held[0]) == (key, self.latest[key])
                assert self.fence.holds(key, held)  # type: ignore[arg-type]


test_pending_slots_name_only_slots_holding_their_keys_bytes = SlotFence.TestCase
