"""The adaptive LRU's victims: two walks merged by weighted age.

Probation (its demoted stack from the end, then its log from the head) and main (its log)
are walked side by side; the older block by weighted age goes first (a probation block's age
times the duel's weight), and the victims are taken out only once there are ``n``. Evicted
keys are remembered as ghosts of the queue they left.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcache_offload.control.policies._alru_log import (
    DEMOTED,
    MAIN,
    MAIN_GHOSTS,
    NOWHERE,
    PROBATION,
    PROBATION_GHOSTS,
    STAMP_SHIFT,
    TAIL,
    next_idle,
)
from kvcache_offload.control.policies.base import Blocks, Keys, Protected

if TYPE_CHECKING:
    from kvcache_offload.control.policies.alru import AdaptiveLRUCachePolicy

__all__ = ["select_victims"]


def select_victims(
    policy: AdaptiveLRUCachePolicy, n: int, protected: Protected, keys: Keys, blocks: Blocks
) -> bool:
    # The victims go straight into the manager's two lists: no pair per victim.
    # Two walks (probation: the demoted stack from its end, then the log from its head;
    # main: its log) merged by age; the victims are taken out only once there are ``n``.
    guarded = len(protected) > 0  # the manager passes none: skip the membership tests
    probation, demoted, main = policy._probation, policy._demoted, policy._main
    policy._trim_heads()
    # Probation cursor: an index into the demoted stack (walked down) while ``in_stack``,
    # then into the probation log (walked up); -1: that walk is over.
    in_stack = True
    p = next_idle(policy._demoted, len(demoted.keys) - 1, -1, protected, guarded)
    if p < 0:
        in_stack = False
        p = next_idle(probation, probation.head, 1, protected, guarded)
    m = next_idle(main, main.head, 1, protected, guarded)
    # Victims in the order chosen, appended to the two lists as found: the keys and
    # blocks of the logs' entries (no index boxed per victim); each block's mark still
    # says where it is. Taken back out if there are fewer than ``n``.
    start = len(keys)
    start_blocks = len(blocks)  # the caller's lists need not be the same length
    now, weight = policy._now, policy._duel.weight
    # A demoted block's weighted age, once: its stamp is beyond a native int, so the
    # arithmetic would allocate on every comparison (the same float either way).
    demoted_age = (now - DEMOTED) * weight
    for _victim in range(n):  # not ``_``: compiled, an int object per step
        if p >= 0:
            p_age = (
                demoted_age
                if in_stack
                else (now - (probation.blocks[p].mark >> STAMP_SHIFT)) * weight
            )
            if m < 0 or p_age >= now - (main.blocks[m].mark >> STAMP_SHIFT):
                if in_stack:
                    keys.append(demoted.keys[p])
                    blocks.append(demoted.blocks[p])
                    p = next_idle(policy._demoted, p - 1, -1, protected, guarded)
                    if p < 0:
                        in_stack = False
                        p = next_idle(probation, probation.head, 1, protected, guarded)
                else:
                    keys.append(probation.keys[p])
                    blocks.append(probation.blocks[p])
                    p = next_idle(probation, p + 1, 1, protected, guarded)
                continue
        if m >= 0:
            keys.append(main.keys[m])
            blocks.append(main.blocks[m])
            m = next_idle(main, m + 1, 1, protected, guarded)
        else:
            del keys[start:]
            del blocks[start_blocks:]
            return False
    table = policy._blocks
    ghosts = policy._ghosts
    from_main = from_probation = from_stack = tails = 0
    for i in range(n):
        key = keys[start + i]
        block = blocks[start_blocks + i]
        mark = block.mark
        where = mark & 3
        if where == MAIN:
            ghosts.remember(key, MAIN_GHOSTS)
            from_main += 1
        else:
            ghosts.remember(key, PROBATION_GHOSTS)
            if where == PROBATION:
                from_probation += 1
            else:
                from_stack += 1
            if mark & TAIL:
                tails += 1
        block.mark = NOWHERE
        del table[key]
    main.size -= from_main
    probation.size -= from_probation
    demoted.size -= from_stack
    policy._tails -= tails
    return True
