"""``alru`` (and ``adaptive``, the default, which runs it) learns whether a store's last block
is reused like the rest; it must learn that from each store, however the stores arrive.

An engine storing for several requests, or into a tier with room to spare, makes stores
follow one another with no other manager call in between. Merged into one batch, only the
last store's tail was seen as a tail and the others' tails counted as used blocks; after a
stores-only period the policy then judged tails dead and evicted every store's last block
at the next store, while hundreds of blocks never used sat older in the tier. A serving
stream lost the blocks it was about to load (bench.serving under the default config).
"""

from __future__ import annotations

import pytest

from kvcache_offload import CPUOffloadingManager
from tests.unit._manager_steps import fresh_keys, reuse, store


@pytest.mark.parametrize("policy", ["alru", "adaptive"])
def test_stores_back_to_back_do_not_teach_the_policy_that_tails_are_dead(policy: str) -> None:
    manager = CPUOffloadingManager(256, policy)
    requests = [fresh_keys(4) for _ in range(32)]
    for keys in requests:  # back to back into an empty tier: no call in between
        store(manager, keys)
    for _ in range(3):  # every block of every request is reused alike, tails included
        for keys in requests:
            reuse(manager, keys)
    for _ in range(1000):  # a stores-only period: nothing is reused
        store(manager, fresh_keys(4))
    hot = [fresh_keys(4) for _ in range(16)]
    for keys in hot:
        store(manager, keys)
    for keys in hot:
        manager.touch(keys)
    for _ in range(16):
        store(manager, fresh_keys(4))
    # 64 blocks just stored and used, in a tier of 256 whose other blocks were never used:
    # every one of them is still there.
    missing = [k for keys in hot for k in keys if not manager.lookup(k)]
    assert missing == []
