"""How often a store's last block is used again, compared with the store's other blocks.

The adaptive LRU demotes store tails (to the front of probation) when they are used far less
than the rest: a prompt's partial last block, which the next turn rewrites.
"""

from __future__ import annotations

from typing import final


@final
class TailStats:
    """Decaying counts of stored and later used blocks: store tails versus the rest.

    Four float attributes, not two lists: compiled, each is a native double, where an item of
    a list of floats is a float object allocated anew on every count."""

    __slots__ = ("_budget", "_period", "stored_other", "stored_tails", "used_other", "used_tails")

    def __init__(self, period: int) -> None:
        self._period = period
        self._budget = period
        # A prior of one use in one store, for tails and for the others.
        self.stored_tails = 1.0
        self.stored_other = 1.0
        self.used_tails = 1.0
        self.used_other = 1.0

    def add_store(self, blocks: int) -> None:
        self.stored_tails += 1
        self.stored_other += blocks - 1
        self._budget -= blocks
        if self._budget <= 0:
            self._budget = self._period
            self.stored_tails /= 2
            self.stored_other /= 2
            self.used_tails /= 2
            self.used_other /= 2

    def add_use(self, tail: bool) -> None:
        if tail:
            self.used_tails += 1
        else:
            self.used_other += 1

    def tails_are_dead(self, ratio: float) -> bool:
        tail_rate = self.used_tails / self.stored_tails
        other_rate = self.used_other / self.stored_other
        return tail_rate < ratio * other_rate
