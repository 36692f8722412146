"""S3-FIFO, SIEVE, SLRU and the prefix-aware S3-FIFO: what each evicts, and the shared rules."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache_offload import CPUOffloadingManager, OffloadKey
from kvcache_offload.control.policies import (
    AdaptiveLRUCachePolicy,
    BlockStatus,
    CachePolicy,
    LRUCachePolicy,
    PrefixS3FIFOCachePolicy,
    S3FIFOCachePolicy,
    SIEVECachePolicy,
    SLRUCachePolicy,
    get_cache_policy_cls,
)
from kvcache_offload.control.policies._mini_sim import WeightDuel
from tests.unit._duel_kinds import DUEL_KINDS
from tests.unit._keys import key, key_ids, keys

NEW_POLICIES = ["alru", "s3fifo", "s3fifo-prefix", "sieve", "slru", "lru2", "adaptive"]


def _make(policy: str | type[CachePolicy], capacity: int = 10) -> CachePolicy:
    cls = get_cache_policy_cls(policy) if isinstance(policy, str) else policy
    return cls(capacity)


def _store(policy: CachePolicy, *ids: int, ref_cnt: int = 0) -> dict[int, BlockStatus]:
    """Insert ``ids`` as one store (prefix order) and complete it with ``ref_cnt``."""
    blocks = {i: BlockStatus(i) for i in ids}
    for i in ids:
        policy.insert(key(i), blocks[i])
    for block in blocks.values():
        block.ref_cnt = ref_cnt
    return blocks


def _evicted_ids(policy: CachePolicy, n: int, protected: frozenset[OffloadKey] = frozenset()):
    victims = policy.evict(n, protected)
    assert victims is not None
    return key_ids(k for k, _ in victims)


def _attributes(policy: CachePolicy) -> dict[str, object]:
    """The policy's instance attributes, whether it is compiled (mypyc: no ``__dict__``,
    the names are in ``__mypyc_attrs__``) or not."""
    if hasattr(policy, "__dict__") and not hasattr(type(policy), "__mypyc_attrs__"):
        return dict(vars(policy))
    names = {name for name in type(policy).__mypyc_attrs__ if name != "__dict__"}
    return {name: getattr(policy, name) for name in names if hasattr(policy, name)}


def _snapshot(policy: CachePolicy) -> str:
    """Everything the policy holds, order included, as text."""
    parts = []
    for name, value in sorted(_attributes(policy).items()):
        if isinstance(value, OrderedDict):
            value = list(value.items())
        elif isinstance(value, set):
            value = sorted(value)
        elif isinstance(value, dict):
            # A block's ``mark`` (the policy's use count or visited bit) is state too.
            value = sorted(
                (k, (v, v.mark) if isinstance(v, BlockStatus) else v) for k, v in value.items()
            )
        parts.append(f"{name}={value!r}")
    return "\n".join(parts)


class _CountingSet(frozenset[OffloadKey]):
    """A protected set that counts membership checks (the eviction's work)."""

    checks = 0

    def __contains__(self, item: object) -> bool:
        type(self).checks += 1
        return super().__contains__(item)


# -- rules every new policy honours -------------------------------------------------------


@pytest.mark.parametrize("name", NEW_POLICIES)
def test_registered_with_its_name(name: str) -> None:
    assert get_cache_policy_cls(name).name == name


@pytest.mark.parametrize("name", NEW_POLICIES)
def test_pinned_writing_and_protected_blocks_are_never_evicted(name: str) -> None:
    policy = _make(name)
    _store(policy, 1, 2)
    _store(policy, 3, ref_cnt=-1)  # being written
    _store(policy, 4, ref_cnt=2)  # being read
    _store(policy, 5, 6)
    victims = _evicted_ids(policy, 3, frozenset(keys(2)))
    assert sorted(victims) == [1, 5, 6]
    assert policy.evict(1, frozenset(keys(2))) is None
    assert sorted(_evicted_ids(policy, 1)) == [2]
    assert len(policy) == 2


@pytest.mark.parametrize("name", NEW_POLICIES)
def test_failed_eviction_changes_nothing(name: str) -> None:
    policy = _make(name)
    _store(policy, 1, 2, 3, 4)
    _store(policy, 5, ref_cnt=1)
    policy.touch(keys(1, 3))
    _evicted_ids(policy, 1)  # move hands and queues off their start
    policy.touch(keys(2, 4))
    present = [k for k in keys(1, 2, 3, 4) if policy.get(k) is not None]
    before = _snapshot(policy)
    # Block 5 is pinned and one idle block is protected: one victim short.
    assert policy.evict(len(present), frozenset(present[:1])) is None
    assert _snapshot(policy) == before
    assert policy.evict(len(present) - 1, frozenset(present[:1])) is not None


@pytest.mark.parametrize("name", NEW_POLICIES)
def test_evict_zero_and_remove_and_clear(name: str) -> None:
    policy = _make(name)
    _store(policy, 1, 2, 3)
    assert policy.evict(0, frozenset()) == []
    policy.remove(key(2))
    assert policy.get(key(2)) is None
    assert len(policy) == 2
    assert sorted(_evicted_ids(policy, 2)) == [1, 3]
    _store(policy, 4)
    policy.clear()
    assert len(policy) == 0
    assert policy.get(key(4)) is None
    assert policy.evict(1, frozenset()) is None


@pytest.mark.parametrize("name", NEW_POLICIES)
def test_eviction_work_is_proportional_to_victims_not_cache_size(name: str) -> None:
    policy = _make(name, capacity=2000)
    for i in range(0, 2000, 20):
        _store(policy, *range(i, i + 20))
    _CountingSet.checks = 0
    for _ in range(10):
        assert policy.evict(2, _CountingSet()) is not None
    assert _CountingSet.checks <= 40


@pytest.mark.parametrize("name", NEW_POLICIES)
def test_a_store_just_prepared_is_not_an_access(name: str) -> None:
    touched, fresh = _make(name), _make(name)
    for policy in (touched, fresh):
        blocks = _store(policy, 1, ref_cnt=-1)
        # The other policy gets an unrelated touch so both see the same store batches.
        policy.touch(keys(1) if policy is touched else keys(99))
        blocks[1].ref_cnt = 0
        _store(policy, 2)
    assert _evicted_ids(touched, 1) == _evicted_ids(fresh, 1)


@settings(max_examples=50, deadline=None)
@given(
    name=st.sampled_from(NEW_POLICIES),
    ops=st.lists(
        st.tuples(st.sampled_from(["store", "touch", "evict", "pin"]), st.integers(0, 15)),
        max_size=60,
    ),
)
def test_evict_returns_exactly_n_idle_unprotected_blocks_or_none(
    name: str, ops: list[tuple[str, int]]
) -> None:
    policy = _make(name, capacity=8)
    blocks: dict[int, BlockStatus] = {}
    for op, i in ops:
        # A store names keys i and i + 16; the manager never stores a key the policy holds,
        # so neither may be held already (one can outlive the other's eviction).
        if op == "store" and i not in blocks and i + 16 not in blocks and len(blocks) < 8:
            blocks.update(_store(policy, i, i + 16))
        elif op == "touch":
            policy.touch(keys(i, i + 16, i + 1))
        elif op == "pin" and i in blocks:
            blocks[i].ref_cnt = 1 - blocks[i].ref_cnt  # toggle being read
        elif op == "evict":
            n = i % 4
            protected = frozenset(keys(i, i + 1))
            idle = [j for j, b in blocks.items() if b.ref_cnt == 0 and key(j) not in protected]
            victims = policy.evict(n, protected)
            if len(idle) < n:
                assert victims is None
                continue
            assert victims is not None and len(victims) == n
            for k, block in victims:
                (j,) = key_ids([k])
                assert blocks.pop(j) is block and block.ref_cnt == 0 and k not in protected
        assert len(policy) == len(blocks)
        state = policy.debug_state()
        # Ghost lists are bounded by the capacity (LRU-2 keeps ``history`` x capacity).
        bound = 8 * int(getattr(policy, "history", 1))
        for ghost in ("ghost", "main_ghost"):
            assert int(state.get(ghost, 0)) <= bound  # type: ignore[call-overload]


# -- what each policy evicts ---------------------------------------------------------------


def test_s3fifo_evicts_unused_new_blocks_and_promotes_used_ones() -> None:
    policy = S3FIFOCachePolicy(10)  # small queue target: 1 block
    _store(policy, 1, 2, 3, 4)
    policy.touch(keys(1))
    assert _evicted_ids(policy, 1) == [2], "1 was used while small, so it moves to main"
    assert policy.debug_state()["main"] == 1
    assert policy.debug_state()["ghost"] == 1


def test_s3fifo_ghost_hit_goes_straight_to_main() -> None:
    policy = S3FIFOCachePolicy(10)
    _store(policy, 1, 2)
    assert _evicted_ids(policy, 1) == [1]
    _store(policy, 1)
    state = policy.debug_state()
    assert (state["small"], state["main"], state["ghost"]) == (1, 1, 0)


def test_s3fifo_main_queue_reinserts_used_blocks() -> None:
    policy = S3FIFOCachePolicy(10)
    _store(policy, 1, 2)
    _evicted_ids(policy, 2)
    _store(policy, 1, 2)  # both ghost hits: main = [1, 2]
    policy.touch(keys(1))
    assert _evicted_ids(policy, 1) == [2], "1 is reinserted once for its use"
    assert _evicted_ids(policy, 1) == [1]


def test_s3fifo_keeps_the_head_of_a_store_in_prefix_variant_only() -> None:
    plain, prefix = S3FIFOCachePolicy(10), PrefixS3FIFOCachePolicy(10)
    for policy in (plain, prefix):
        _store(policy, 1, 2, 3)
    assert _evicted_ids(plain, 1) == [1]
    assert _evicted_ids(prefix, 1) == [3], "the prefix tail leaves first"


def test_prefix_s3fifo_moves_its_small_target_on_ghost_hits() -> None:
    policy = PrefixS3FIFOCachePolicy(10)
    start = float(policy.debug_state()["small_target"])  # type: ignore[arg-type]
    _store(policy, *range(1, 11))
    _evicted_ids(policy, 2)  # from the small queue: tail first, 10 then 9
    _store(policy, 10)  # small-ghost hit: the small queue was too small
    grown = float(policy.debug_state()["small_target"])  # type: ignore[arg-type]
    assert grown > start
    policy.touch(keys(10))
    main_victims = []
    while len(main_victims) < 1:
        victims = policy.evict(1, frozenset())
        assert victims is not None
        main_victims += [k for k, _ in victims if k == key(10)]
    _store(policy, 10)  # main-ghost hit: the main queue was too small
    assert float(policy.debug_state()["small_target"]) < grown  # type: ignore[arg-type]


def test_prefix_s3fifo_main_queue_keeps_prefix_heads_most_recent() -> None:
    policy = PrefixS3FIFOCachePolicy(4)
    _store(policy, 1, 2)
    _evicted_ids(policy, 2)
    _store(policy, 1, 2)  # ghost hits: both in the main LRU
    policy.touch(keys(1, 2))  # reverse order: 1 ends most recent
    assert _evicted_ids(policy, 1) == [2]


def test_sieve_hand_skips_visited_blocks_and_clears_their_bit() -> None:
    policy = SIEVECachePolicy(10)
    _store(policy, 1, 2, 3, 4)
    policy.touch(keys(1, 3))
    assert _evicted_ids(policy, 1) == [2]
    assert _evicted_ids(policy, 1) == [4]
    assert _evicted_ids(policy, 1) == [1], "the hand wrapped; 1's bit was cleared"
    assert _evicted_ids(policy, 1) == [3]


def test_sieve_new_blocks_join_behind_the_hand() -> None:
    policy = SIEVECachePolicy(10)
    _store(policy, 1, 2, 3)
    policy.touch(keys(1, 2, 3))
    assert _evicted_ids(policy, 1) == [1]  # full lap clears 1, 2, 3; then 1 goes
    _store(policy, 4)
    assert _evicted_ids(policy, 2) == [2, 3]
    assert _evicted_ids(policy, 1) == [4]


class _QueueModel(Protocol):
    """What the queue-policy models below offer the shared driver."""

    blocks: dict[OffloadKey, BlockStatus]

    def store(self, ks: list[OffloadKey], blocks: list[BlockStatus]) -> None: ...
    def touch(self, ks: list[OffloadKey]) -> None: ...
    def remove(self, k: OffloadKey) -> None: ...
    def evict(self, n: int, protected: frozenset[OffloadKey]) -> list[OffloadKey] | None: ...


def _step_against_model(policy: CachePolicy, model: _QueueModel, op: str, ids: list[int]) -> None:
    """One random operation on both: a store of the new ``ids`` (as one store), a touch, a
    pin or unpin of the first present one, its removal, or an eviction of ``len(ids)``
    blocks protecting the other present ones (which must pick the same victims, or fail
    alike)."""
    present = [key(i) for i in ids if key(i) in model.blocks]
    if op == "store":
        new = [i for i in dict.fromkeys(ids) if key(i) not in model.blocks]
        blocks = [BlockStatus(i) for i in new]
        policy.insert_many([(key(i), b) for i, b in zip(new, blocks, strict=True)])
        model.store([key(i) for i in new], blocks)
        for block in blocks:
            block.ref_cnt = 0
    elif op == "touch":
        ks = [key(i) for i in ids]
        policy.touch(ks)
        model.touch(ks)
    elif op in ("pin", "unpin") and present:
        block = model.blocks[present[0]]
        block.ref_cnt = max(0, block.ref_cnt + (1 if op == "pin" else -1))
    elif op == "remove" and present:
        policy.remove(present[0])
        model.remove(present[0])
    elif op == "evict":
        protected = frozenset(present[1:])
        got = policy.evict(len(ids), protected)
        want = model.evict(len(ids), protected)
        assert (None if got is None else [k for k, _ in got]) == want


def _drain_against_model(policy: CachePolicy, model: _QueueModel) -> None:
    """Unpin everything and evict it all: the whole queue order must be the model's."""
    for block in model.blocks.values():
        block.ref_cnt = 0
    order = policy.evict(len(model.blocks), frozenset()) if model.blocks else []
    assert order is not None
    assert [k for k, _ in order] == model.evict(len(model.blocks), frozenset())


class _ModelSieve:
    """SIEVE as two ordered dicts split at the hand, planned then applied: the plain
    model the log-based policy must match."""

    def __init__(self) -> None:
        self.ahead: OrderedDict[OffloadKey, None] = OrderedDict()
        self.behind: OrderedDict[OffloadKey, None] = OrderedDict()
        self.visited: dict[OffloadKey, bool] = {}
        self.blocks: dict[OffloadKey, BlockStatus] = {}

    def store(self, ks: list[OffloadKey], blocks: list[BlockStatus]) -> None:
        for k, block in zip(ks, blocks, strict=True):
            self.blocks[k] = block
            self.ahead[k] = None
            self.visited[k] = False

    def touch(self, ks: list[OffloadKey]) -> None:
        for k in ks:
            if k in self.blocks and self.blocks[k].ref_cnt != -1:
                self.visited[k] = True

    def remove(self, k: OffloadKey) -> None:
        del self.blocks[k], self.visited[k]
        self.ahead.pop(k, None)
        self.behind.pop(k, None)

    def evict(self, n: int, protected: frozenset[OffloadKey]) -> list[OffloadKey] | None:
        walk = list(self.ahead) + list(self.behind)
        plan: list[tuple[str, OffloadKey]] = []
        cleared: set[OffloadKey] = set()
        victims = idle = 0
        while victims < n:
            if not walk or idle > len(self.blocks):
                return None
            k = walk.pop(0)
            if self.blocks[k].ref_cnt != 0 or k in protected:
                plan.append(("keep", k))
                walk.append(k)
                idle += 1
            elif self.visited[k] and k not in cleared:
                cleared.add(k)
                plan.append(("clear", k))
                walk.append(k)
                idle = 0
            else:
                plan.append(("evict", k))
                victims += 1
                idle = 0
        out = []
        for move, k in plan:
            if not self.ahead:
                self.ahead, self.behind = self.behind, self.ahead
            del self.ahead[k]
            if move == "evict":
                del self.blocks[k], self.visited[k]
                out.append(k)
            else:
                self.behind[k] = None
                if move == "clear":
                    self.visited[k] = False
        return out


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["store", "store", "touch", "pin", "pin", "unpin", "evict", "remove"]),
            st.lists(st.integers(0, 15), min_size=1, max_size=5),
        ),
        min_size=20,
        max_size=300,
    )
)
def test_sieve_log_decides_as_the_ordered_dict_model(
    ops: list[tuple[str, list[int]]],
) -> None:
    # Pinned and protected blocks, failed evictions (which must change nothing, visited
    # bits included), removals, laps and the log's compactions.
    policy = SIEVECachePolicy(1000)
    model = _ModelSieve()
    for op, ids in ops:
        _step_against_model(policy, model, op, ids)
        assert len(policy) == len(model.blocks)
    state = policy.debug_state()
    assert state["visited"] == sum(model.visited.values())
    assert state["queue"] == len(model.blocks)
    _drain_against_model(policy, model)  # the rest of the queue, in the hand's order


class _ModelS3FIFO:
    """S3-FIFO as ordered dicts with victims planned then applied, with the policy's class
    settings: the plain model the log-based one must match."""

    def __init__(self, cls: type[S3FIFOCachePolicy], capacity: int) -> None:
        self.cls, self.capacity = cls, capacity
        self.small: OrderedDict[OffloadKey, None] = OrderedDict()
        self.main: OrderedDict[OffloadKey, None] = OrderedDict()
        self.count: dict[OffloadKey, int] = {}
        self.blocks: dict[OffloadKey, BlockStatus] = {}
        self.target = float(max(1, round(capacity * cls.small_ratio)))
        limit = capacity if cls.adaptive else max(1, capacity - int(self.target))
        self.ghosts: list[OrderedDict[OffloadKey, None]] = [OrderedDict(), OrderedDict()]
        self.limit = limit

    def store(self, ks: list[OffloadKey], blocks: list[BlockStatus]) -> None:
        pairs = list(zip(ks, blocks, strict=True))
        for k, block in reversed(pairs) if self.cls.prefix_order else pairs:
            self.blocks[k] = block
            self.count[k] = 0
            ghost, main_ghost = self.ghosts
            gain = self.cls.adapt_gain
            if k in ghost:
                if self.cls.adaptive:
                    step = gain * max(1.0, len(main_ghost) / len(ghost))
                    self.target = min(self.target + step, float(self.capacity))
                del ghost[k]
                self.main[k] = None
            elif k in main_ghost:
                self.target = max(self.target - gain * max(1.0, len(ghost) / len(main_ghost)), 1.0)
                del main_ghost[k]
                self.main[k] = None
            else:
                self.small[k] = None

    def touch(self, ks: list[OffloadKey]) -> None:
        for k in reversed(ks):
            if k not in self.blocks or self.blocks[k].ref_cnt == -1:
                continue
            if self.cls.main_lru and k in self.main:
                self.main.move_to_end(k)
            elif self.count[k] < 3:
                self.count[k] += 1

    def remove(self, k: OffloadKey) -> None:
        del self.blocks[k], self.count[k]
        self.small.pop(k, None)
        self.main.pop(k, None)

    def _remember(self, which: int, k: OffloadKey) -> None:
        ghosts = self.ghosts[which]
        ghosts[k] = None
        if len(ghosts) > self.limit:
            ghosts.popitem(last=False)

    def evict(self, n: int, protected: frozenset[OffloadKey]) -> list[OffloadKey] | None:
        def idle(k: OffloadKey) -> bool:
            return self.blocks[k].ref_cnt == 0 and k not in protected

        small_walk = list(self.small)
        main_walk = list(self.main)
        plan: list[tuple[str, OffloadKey]] = []
        freq: dict[OffloadKey, int] = {}
        small_len, victims = len(self.small), 0
        small_done = main_done = False
        while victims < n:
            if not small_done and (small_len >= self.target or main_done):
                k = next((k for k in small_walk if idle(k)), None)
                if k is not None:
                    small_walk = small_walk[small_walk.index(k) + 1 :]
                    small_len -= 1
                    if self.count[k] > 0:
                        plan.append(("promote", k))
                        freq[k] = 0
                        main_walk.append(k)
                        main_done = False
                    else:
                        plan.append(("small", k))
                        victims += 1
                    continue
                small_walk = []
                small_done = True
            if main_done:
                return None
            while main_walk and not idle(main_walk[0]):
                main_walk.pop(0)
            if not main_walk:
                main_done = True
                if small_done:
                    return None
                continue
            k = main_walk.pop(0)
            count = freq.get(k, self.count[k])
            if not self.cls.main_lru and count > 0:
                freq[k] = count - 1
                plan.append(("reinsert", k))
                main_walk.append(k)
                continue
            plan.append(("main", k))
            victims += 1
        out = []
        for move, k in plan:
            if move == "promote":
                del self.small[k]
                self.main[k] = None
                self.count[k] = 0
            elif move == "reinsert":
                self.main.move_to_end(k)
                self.count[k] -= 1
            else:
                if move == "small":
                    del self.small[k]
                    self._remember(0, k)
                else:
                    del self.main[k]
                    if self.cls.adaptive:
                        self._remember(1, k)
                del self.blocks[k], self.count[k]
                out.append(k)
        return out


@pytest.mark.parametrize("cls", [S3FIFOCachePolicy, PrefixS3FIFOCachePolicy])
@settings(max_examples=120, deadline=None)
@given(
    capacity=st.integers(2, 24),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["store", "store", "touch", "pin", "unpin", "evict", "remove"]),
            st.lists(st.integers(0, 30), min_size=1, max_size=5),
        ),
        min_size=20,
        max_size=300,
    ),
)
def test_s3fifo_logs_decide_as_the_ordered_dict_model(
    cls: type[S3FIFOCachePolicy], capacity: int, ops: list[tuple[str, list[int]]]
) -> None:
    # Promotions, reinsertions, ghost hits (and the adaptive target), pinned and protected
    # blocks, failed evictions (which must change nothing), removals, log compactions.
    policy = cls(capacity)
    model = _ModelS3FIFO(cls, capacity)
    for op, ids in ops:
        _step_against_model(policy, model, op, ids)
        state = policy.debug_state()
        assert (state["small"], state["main"]) == (len(model.small), len(model.main))
        assert (state["ghost"], state["main_ghost"]) == tuple(len(g) for g in model.ghosts)
        assert state["small_target"] == model.target
    _drain_against_model(policy, model)


def test_s3fifo_eviction_that_fails_changes_nothing() -> None:
    policy = S3FIFOCachePolicy(10)
    blocks = _store(policy, 1, 2, 3, 4)
    policy.touch(keys(1, 3))  # used on probation: promoted by the walk
    blocks[4].ref_cnt = 1
    before = policy.debug_state()
    assert policy.evict(4, frozenset()) is None  # 1 and 3 promoted, 2 evicted, 4 pinned
    assert policy.debug_state() == before
    assert _evicted_ids(policy, 3) == [2, 1, 3]


def test_sieve_eviction_that_fails_leaves_the_visited_bits_it_cleared() -> None:
    policy = SIEVECachePolicy(10)
    blocks = _store(policy, 1, 2, 3)
    policy.touch(keys(1))
    blocks[2].ref_cnt = blocks[3].ref_cnt = 1  # being read: only 1 can go
    assert policy.evict(2, frozenset()) is None
    assert policy.debug_state()["visited"] == 1
    blocks[2].ref_cnt = blocks[3].ref_cnt = 0
    assert _evicted_ids(policy, 1) == [2], "1 is still visited: the hand clears it, takes 2"


def test_slru_evicts_probation_before_protected() -> None:
    policy = SLRUCachePolicy(10)
    _store(policy, 1, 2, 3, 4)
    policy.touch(keys(2))
    assert _evicted_ids(policy, 3) == [1, 3, 4]
    assert _evicted_ids(policy, 1) == [2]
    _store(policy, 2)  # evicted from protected: comes back protected
    assert policy.debug_state()["protected"] == 1


def test_slru_touch_keeps_the_first_key_most_recent() -> None:
    policy = SLRUCachePolicy(10)
    _store(policy, 1, 2, 3)
    policy.touch(keys(1, 2, 3))
    assert _evicted_ids(policy, 3) == [3, 2, 1]


def test_slru_demotes_the_protected_overflow_to_probation() -> None:
    policy = SLRUCachePolicy(5)  # protected share: 4 blocks
    _store(policy, *range(1, 6))
    policy.touch(keys(5, 4, 3, 2, 1))  # applied in reverse: 1 promoted first, 5 last
    state = policy.debug_state()
    assert (state["protected"], state["probation"]) == (4, 1)
    assert _evicted_ids(policy, 1) == [1], "the least recent protected block dropped back"


class _PlainAdaptiveLRU(AdaptiveLRUCachePolicy):
    dead_tail_ratio = 0.0  # never demote store tails


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["store", "touch", "evict", "pin"]), st.integers(0, 12)),
        max_size=80,
    )
)
def test_alru_at_weight_one_evicts_exactly_like_lru(ops: list[tuple[str, int]]) -> None:
    alru, lru = _PlainAdaptiveLRU(6), LRUCachePolicy(6)
    blocks: dict[int, list[BlockStatus]] = {}
    for op, i in ops:
        if op == "store" and i not in blocks and len(blocks) < 6:
            blocks[i] = [*_store(alru, i).values(), *_store(lru, i).values()]
            alru.touch([])  # close the store batch: each store is one prepare_store
        elif op == "touch":
            alru.touch(keys(i, i + 1))
            lru.touch(keys(i, i + 1))
        elif op == "pin" and i in blocks:
            for block in blocks[i]:
                block.ref_cnt = 1 - block.ref_cnt
        elif op == "evict":
            protected = frozenset(keys(i))
            a, b = alru.evict(1 + i % 2, protected), lru.evict(1 + i % 2, protected)
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                assert [k for k, _ in a] == [k for k, _ in b]
                for k, _ in a:
                    blocks.pop(key_ids([k])[0])
    assert alru.debug_state()["weight"] == 1.0


def test_alru_learns_that_store_tails_are_dead_and_evicts_them_first() -> None:
    policy = AdaptiveLRUCachePolicy(100)
    for turn in range(6):
        a, b, c = 10 * turn, 10 * turn + 1, 10 * turn + 2
        _store(policy, a, b, c)
        policy.touch(keys(a, b))  # the tail c is never used again
    assert policy.debug_state()["demote_tails"] is True
    _store(policy, 100, 101, 102)
    assert _evicted_ids(policy, 1) == [102]


def test_alru_keeps_store_tails_in_order_when_they_are_reused() -> None:
    policy = AdaptiveLRUCachePolicy(100)
    for turn in range(6):
        ids = (10 * turn, 10 * turn + 1, 10 * turn + 2)
        _store(policy, *ids)
        policy.touch(keys(*ids))
    assert policy.debug_state()["demote_tails"] is False
    _store(policy, 100, 101, 102)
    assert _evicted_ids(policy, 1) == [2], "plain LRU order: the oldest tail goes first"


def _access(policy: CachePolicy, i: int) -> None:
    """One request for block ``i``: touch, and store it on a miss (evicting one if full)."""
    policy.touch(keys(i))
    if policy.get(key(i)) is None:
        if len(policy) >= 64:
            assert policy.evict(1, frozenset()) is not None
        _store(policy, i)


def test_alru_duel_raises_the_weight_when_one_off_blocks_flush_a_hot_set() -> None:
    policy = AdaptiveLRUCachePolicy(64)
    scan = 1000
    for round_ in range(40):
        for hot in range(40):
            _access(policy, hot)
            for _ in range(2):
                scan += 1
                _access(policy, scan)
        if round_ == 0:
            assert policy.debug_state()["weight"] == 1.0
    assert float(policy.debug_state()["weight"]) > 1.0  # type: ignore[arg-type]
    hot_cached = sum(policy.get(key(i)) is not None for i in range(40))
    assert hot_cached > 20


def test_alru_duel_keeps_lru_when_recency_is_all_there_is() -> None:
    policy = AdaptiveLRUCachePolicy(64)
    for _ in range(100):
        for i in range(48):  # a loop that fits: every access after the first lap hits
            _access(policy, i)
    assert policy.debug_state()["weight"] == 1.0


# -- through the manager, on a prefix workload ----------------------------------------------


def _conversations(turns: int) -> Iterator[list[OffloadKey]]:
    """Three chats behind one system prompt; each turn repeats its chat and adds two blocks."""
    chats: list[list[int]] = [[0], [0], [0]]
    next_id = 1
    for turn in range(turns):
        chat = chats[turn % 3]
        chat.extend((next_id, next_id + 1))
        next_id += 2
        yield keys(*chat)
        yield keys(0, 10_000 + turn, 20_000 + turn)  # a one-off request


@pytest.mark.parametrize("name", NEW_POLICIES)
def test_manager_replay_keeps_working_and_hits(name: str) -> None:
    manager = CPUOffloadingManager(40, name)
    hits = total = 0
    for request in _conversations(30):
        n = 0
        while n < len(request) and manager.lookup(request[n]):
            n += 1
        manager.touch(request)
        if n:
            manager.prepare_load(request[:n])
            manager.complete_load(request[:n])
        out = manager.prepare_store(request[n:])
        if out is not None:
            manager.complete_store(out.keys_to_store)
        hits += n
        total += len(request)
    assert len(manager.policy) <= 40
    assert hits / total > 0.2


# -- the ghost list ----------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([0, 1, 2, 3, 6, 50]),
    st.lists(
        st.tuples(
            st.sampled_from(["remember", "recall", "recall_stamp", "pop"]), st.integers(0, 9)
        ),
        max_size=400,
    ),
)
def test_ghost_list_forgets_like_an_ordered_dict_of_its_remembers(
    limit: int, ops: list[tuple[str, int]]
) -> None:
    # Recalls leave dead log entries; a list that never fills (limit 50) compacts its log.
    from kvcache_offload.control.policies._ghosts import GhostList

    ghosts = GhostList(limit)
    model: OrderedDict[OffloadKey, int] = OrderedDict()
    for step, (op, i) in enumerate(ops):
        k = key(i)
        if op == "remember":
            ghosts.remember(k, step)
            model.setdefault(k, step)
            if len(model) > limit:
                model.popitem(last=False)
        elif op == "recall":
            assert ghosts.recall(k) == (model.pop(k, None) is not None)
        elif op == "recall_stamp":
            assert ghosts.recall_stamp(k) == model.pop(k, -1)
        else:
            ghosts.pop(k)
            model.pop(k, None)
        assert len(ghosts) == len(model)
        assert [i for i in range(10) if key(i) in ghosts] == [
            i for i in range(10) if key(i) in model
        ]


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([0, 1, 2, 3, 6, 50]),
    st.lists(
        st.tuples(
            st.sampled_from(["remember", "remember", "recall_stamp", "pop"]), st.integers(0, 9)
        ),
        max_size=600,
    ),
)
def test_stamped_ghost_list_forgets_like_a_ghost_list(
    limit: int, ops: list[tuple[str, int]]
) -> None:
    # Stamps unique per remember (as LRU-2's last accesses are), small ones included (int
    # objects shared by value): the entry-by-stamp liveness must forget exactly as the
    # dead-count one, through recalls, trims and compactions.
    from kvcache_offload.control.policies._ghosts import GhostList, StampedGhostList

    ghosts = StampedGhostList(limit)
    reference = GhostList(limit)
    for step, (op, i) in enumerate(ops):
        k = key(i)
        if op == "remember":
            ghosts.remember(k, step)
            reference.remember(k, step)
        elif op == "recall_stamp":
            assert ghosts.recall_stamp(k) == reference.recall_stamp(k)
        else:
            ghosts.pop(k)
            reference.pop(k)
        assert len(ghosts) == len(reference)
        assert [i for i in range(10) if key(i) in ghosts] == [
            i for i in range(10) if key(i) in reference
        ]
    assert [ghosts.recall_stamp(key(i)) for i in range(10)] == [
        reference.recall_stamp(key(i)) for i in range(10)
    ]


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from([1, 5, 40, 1000]),
    st.lists(
        st.tuples(
            st.sampled_from(["remember", "remember", "recall", "recall_stamp"]),
            st.integers(0, 150),
            st.integers(0, 2**40),
        ),
        min_size=200,
        max_size=1500,
    ),
)
def test_ghost_list_keeps_large_stamps_through_trims_and_compactions(
    limit: int, ops: list[tuple[str, int, int]]
) -> None:
    # Each ghost's value packs its stamp above its log position: stamps past 2**32 survive,
    # and so do the positions renumbered when the log is trimmed or compacted.
    from kvcache_offload.control.policies._ghosts import GhostList

    ghosts = GhostList(limit)
    model: OrderedDict[OffloadKey, int] = OrderedDict()
    for op, i, stamp in ops:
        k = key(i)
        if op == "remember":
            ghosts.remember(k, stamp)
            model.setdefault(k, stamp)
            if len(model) > limit:
                model.popitem(last=False)
        elif op == "recall":
            assert ghosts.recall(k) == (model.pop(k, None) is not None)
        else:
            assert ghosts.recall_stamp(k) == model.pop(k, -1)
        assert len(ghosts) == len(model)
    assert [ghosts.recall_stamp(k) for k in list(model)] == list(model.values())


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([1, 2, 3, 6, 50]),
    st.lists(
        st.tuples(
            st.sampled_from(["remember", "remember", "recall"]),
            st.integers(0, 1),
            st.integers(0, 20),
        ),
        max_size=600,
    ),
)
def test_ghost_pair_forgets_like_two_ghost_lists(
    limit: int, ops: list[tuple[str, int, int]]
) -> None:
    # One dict for both lists (a key is a ghost of at most one): each list still forgets its
    # own oldest, through recalls' dead entries, trims and compactions (limit 50 never fills).
    from kvcache_offload.control.policies._ghosts import GhostList, GhostPair

    pair = GhostPair(limit)
    lists = (GhostList(limit), GhostList(limit))
    for op, which, i in ops:
        k = key(i)
        if op == "remember":
            if k in lists[0] or k in lists[1]:
                continue  # the contract: only a key that is a ghost of neither
            pair.remember(k, which)
            lists[which].remember(k)
        else:
            expected = 0 if lists[0].recall(k) else 1 if lists[1].recall(k) else -1
            assert pair.recall(k) == expected
        assert (pair.size(0), pair.size(1)) == (len(lists[0]), len(lists[1]))
        assert len(pair) == len(lists[0]) + len(lists[1])
        assert [i for i in range(21) if key(i) in pair] == [
            i for i in range(21) if key(i) in lists[0] or key(i) in lists[1]
        ]
    pair.clear()
    assert (len(pair), pair.size(0), pair.size(1)) == (0, 0, 0)


@pytest.mark.parametrize("native", DUEL_KINDS)
def test_alru_weight_miniatures_forget_the_ids_of_keys_no_copy_holds(native: bool) -> None:
    # The miniatures index their state by small ids shared by all copies; a key that every
    # copy has forgotten (not cached, not a ghost) gives its id back, so a stream of new
    # keys does not grow the tables.
    duel = WeightDuel(64, (1.0, 4.0, 64.0), shadow_blocks=64, native=native)
    for start in range(0, 20_000, 4):
        duel.access([key(i) for i in range(start, start + 4)])
    held = 3 * 3 * 64  # per copy: the cache plus a ghost list per queue, each <= capacity
    assert duel.id_slots() <= held + 4
    assert max(duel.sizes()) == 64


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["push", "push", "take", "take_walked", "evict", "restore"]),
            st.integers(0, 30),
        ),
        min_size=300,
        max_size=600,
    )
)
def test_mark_queue_keeps_arrival_order_of_its_members(ops: list[tuple[str, int]]) -> None:
    # Members leave anywhere (a use), in walk order (an eviction, whose block the manager
    # hands to the next new key, as it does) or with their key (the block table drops it); a
    # key stored again gets a new stamp. Dead entries are skipped, trimmed at the head (also
    # past the oldest members an eviction took) and compacted; the walk must always be the
    # model's order.
    from kvcache_offload.control.policies._mark_queue import MarkQueue

    blocks: dict[OffloadKey, BlockStatus] = {}
    freed: list[BlockStatus] = []  # evicted blocks, reused for the next new keys
    queue = MarkQueue()
    model: list[OffloadKey] = []  # members, oldest first
    stamps: dict[OffloadKey, int] = {}
    clock = 0
    for op, i in ops:
        k = key(i)
        if op == "push" and k not in model:
            block = blocks.get(k)
            if block is None:
                block = blocks[k] = freed.pop() if freed else BlockStatus(i)
            clock += 1
            queue.push(k, block, clock)
            model.append(k)
            stamps[k] = clock
        elif op == "take" and k in model:
            assert queue.take(blocks[k]) == stamps[k]
            blocks[k].mark = -1  # a used block: no longer a member, still stored
            model.remove(k)
        elif op == "take_walked" and model:
            index = queue.first()
            for _ in range(i % len(model)):
                index = queue.after(index)
            taken = queue.key_at(index)
            assert queue.block is blocks[taken]
            queue.take(blocks[taken])
            if taken == model[0]:
                queue.taken_through(index)
            freed.append(blocks.pop(taken))  # evicted
            model.remove(taken)
        elif op == "evict" and k in blocks and k not in model:
            del blocks[k]  # a used block leaves: its old entries stay dead
        elif op == "restore" and k in blocks and k not in model:
            del blocks[k]  # a used block leaves and the key is stored again, a new member
            clock += 1
            block = blocks[k] = BlockStatus(i)
            queue.push(k, block, clock)
            model.append(k)
            stamps[k] = clock
        walked = []
        index = queue.first()
        while index >= 0:
            walked.append(queue.key_at(index))
            assert queue.block is blocks[walked[-1]]
            index = queue.after(index)
        assert walked == model
        assert len(queue) == len(model)
        assert all(MarkQueue.holds(blocks[k]) == (k in model) for k in blocks)


def test_lru2_failed_store_of_a_batched_ghost_key_leaves_no_heap_entry() -> None:
    # Regression: ``remove`` looked for the key among the used blocks before flushing the
    # batch, whose flush then put the ghost key there; the next eviction raised KeyError.
    policy = get_cache_policy_cls("lru2")(2)
    _store(policy, 1, 2)
    policy.touch([])
    (gone,) = _evicted_ids(policy, 1)
    policy.insert(key(gone), BlockStatus(9))  # a ghost key, still in the insert batch
    policy.remove(key(gone))  # its store failed
    _store(policy, 3)
    policy.touch(keys(3))
    assert sorted(_evicted_ids(policy, 2)) == sorted({1, 2, 3} - {gone})
    assert len(policy) == 0


def test_lru2_subclass_enqueue_still_sees_every_stored_key() -> None:
    # The flush enqueues inline; a subclass that overrides ``_enqueue`` must still see each
    # key, tail of the store first, and evict as the plain policy does.
    base = get_cache_policy_cls("lru2")
    seen: list[OffloadKey] = []

    class Recording(base):  # type: ignore[misc, valid-type]
        def _enqueue(self, k: OffloadKey, block: BlockStatus) -> None:
            seen.append(k)
            super()._enqueue(k, block)

    recording, plain = Recording(3), base(3)
    for policy in (recording, plain):
        _store(policy, 1, 2, 3)
        policy.touch(keys(1))
    assert seen == [key(3), key(2), key(1)]
    assert _evicted_ids(recording, 2) == _evicted_ids(plain, 2)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(min_value=1, max_value=2**40), st.none()), max_size=300))
def test_lru2_heap_pops_what_heapq_pops(ops: list[int | None]) -> None:
    # LRU-2's heap sifts its own entries (compiled, with native ints): the same order as
    # heapq for any pushes and pops of distinct stamps.
    import heapq

    from kvcache_offload.control.policies.lru2 import _Heap

    heap, reference, seen = _Heap(), [], set()
    for op in ops:
        if op is None or op in seen:
            if reference:
                stamp = heapq.heappop(reference)
                assert heap.pop() == str(stamp).encode() and heap.stamp == stamp
        else:
            seen.add(op)
            heap.push(op, OffloadKey(str(op).encode()))
            heapq.heappush(reference, op)
        assert len(heap) == len(reference)
    assert [heap.pop() for _ in range(len(reference))] == [
        str(s).encode() for s in sorted(reference)
    ]
