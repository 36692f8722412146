"""The adaptive LRU's cheaper structures decide as plain ordered-dict models of them do.

``alru`` keeps its queues as logs of blocks with each block's queue, stamp and tail flag in
its ``mark``; its weight miniatures share one access time per key; the adaptive policy's race
samples with the CRC the live ``alru`` computes anyway. Each test replays random traffic
through the new structure and a direct model of the old one (ordered dicts, one stamp list per
copy, a CRC per sample) and requires the same victims, sizes, hit counts and samples.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Collection

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache_offload import CPUOffloadingManager, OffloadKey
from kvcache_offload.control.policies import AdaptiveLRUCachePolicy, BlockStatus, _mini_sim
from kvcache_offload.control.policies._mini_sim import WeightDuel
from kvcache_offload.control.policies._shadow_race import ShadowRace
from kvcache_offload.control.policies.adaptive import AdaptiveCachePolicy
from kvcache_offload.errors import ConfigError
from tests.unit._duel_kinds import DUEL_KINDS, needs_native_duel
from tests.unit._keys import key

_DEMOTED = -(1 << 62)


class _OrderedDictALRU:
    """The adaptive LRU as plain structures (two ordered dicts of stamps, two ghost lists, a
    tails dict), at a fixed weight: the model the logs must match."""

    def __init__(self, capacity: int, weight: float) -> None:
        self.weight = weight
        self.capacity = capacity
        self.blocks: dict[OffloadKey, BlockStatus] = {}
        self.batch: list[OffloadKey] = []
        self.probation: OrderedDict[OffloadKey, int] = OrderedDict()
        self.main: OrderedDict[OffloadKey, int] = OrderedDict()
        self.ghost: OrderedDict[OffloadKey, None] = OrderedDict()
        self.main_ghost: OrderedDict[OffloadKey, None] = OrderedDict()
        self.tails: dict[OffloadKey, None] = {}
        self.now = 0
        self.stored = [1.0, 1.0]
        self.used = [1.0, 1.0]
        self.period = self.budget = 4 * max(capacity, 64)
        self.demote_tails = False

    def insert(self, k: OffloadKey, block: BlockStatus) -> None:
        self.blocks[k] = block
        self.batch.append(k)

    def _remember(self, ghosts: OrderedDict[OffloadKey, None], k: OffloadKey) -> None:
        if k in ghosts:
            return
        ghosts[k] = None
        if len(ghosts) > self.capacity:
            ghosts.popitem(last=False)

    def flush(self) -> None:
        if not self.batch:
            return
        tail = self.batch[-1]
        self.stored[0] += 1
        self.stored[1] += len(self.batch) - 1
        self.budget -= len(self.batch)
        if self.budget <= 0:
            self.budget = self.period
            self.stored = [x / 2 for x in self.stored]
            self.used = [x / 2 for x in self.used]
        for k in reversed(self.batch):
            if k in self.blocks:
                self.now += 1
                if k in self.ghost:
                    del self.ghost[k]
                    self.main[k] = self.now
                elif k in self.main_ghost:
                    del self.main_ghost[k]
                    self.main[k] = self.now
                else:
                    self.probation[k] = self.now
        self.batch.clear()
        if tail in self.probation:
            self.tails[tail] = None
            rate = self.used[0] / self.stored[0]
            self.demote_tails = rate < 0.25 * (self.used[1] / self.stored[1])
            if self.demote_tails:
                self.probation[tail] = _DEMOTED
                self.probation.move_to_end(tail, last=False)

    def touch(self, ks: list[OffloadKey]) -> None:
        self.flush()
        for k in reversed(ks):
            block = self.blocks.get(k)
            if block is None:
                continue
            if block.ref_cnt == -1:
                if self.probation.get(k, _DEMOTED) != _DEMOTED:
                    self.now += 1
                    self.probation[k] = self.now
                    self.probation.move_to_end(k)
                continue
            self.now += 1
            if k in self.main:
                self.main[k] = self.now
                self.main.move_to_end(k)
            else:
                del self.probation[k]
                self.main[k] = self.now
                tail = k in self.tails
                self.tails.pop(k, None)
                self.used[0 if tail else 1] += 1

    def remove(self, k: OffloadKey) -> None:
        self.flush()
        del self.blocks[k]
        for queue in (self.probation, self.main, self.tails):
            queue.pop(k, None)

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        self.flush()

        def idle(queue: OrderedDict[OffloadKey, int]) -> list[tuple[OffloadKey, int]]:
            return [
                (k, s)
                for k, s in queue.items()
                if self.blocks[k].ref_cnt == 0 and k not in protected
            ]

        ps, ms = idle(self.probation), idle(self.main)
        chosen: list[tuple[OffloadKey, bool]] = []
        for _ in range(n):
            if ps and (not ms or (self.now - ps[0][1]) * self.weight >= self.now - ms[0][1]):
                chosen.append((ps.pop(0)[0], True))
            elif ms:
                chosen.append((ms.pop(0)[0], False))
            else:
                return None
        for k, on_probation in chosen:
            if on_probation:
                del self.probation[k]
                self.tails.pop(k, None)
                self._remember(self.ghost, k)
            else:
                del self.main[k]
                self._remember(self.main_ghost, k)
            del self.blocks[k]
        return [k for k, _ in chosen]

    def sizes(self) -> dict[str, int]:
        self.flush()
        return {
            "size": len(self.blocks),
            "probation": len(self.probation),
            "main": len(self.main),
            "ghost": len(self.ghost),
            "main_ghost": len(self.main_ghost),
            "tails": len(self.tails),
        }


def _fixed_weight(
    weight: float, span: int = 1 << 30, tokens: int = (1 << 27) - 1
) -> type[AdaptiveLRUCachePolicy]:
    class _Fixed(AdaptiveLRUCachePolicy):
        weights = (weight,)
        stamp_span = span
        log_tokens = tokens

        def _new_duel(self) -> WeightDuel:
            return WeightDuel(self.cache_capacity, self.weights, initial_weight=weight)

    return _Fixed


@settings(max_examples=60, deadline=None)
@given(
    weight=st.sampled_from([1.0, 4.0, 64.0]),
    seed=st.integers(0, 2**31),
    renumber=st.booleans(),
)
def test_alru_logs_evict_exactly_as_ordered_dicts(weight: float, seed: int, renumber: bool) -> None:
    # Requests of a few conversations (growing prefixes, often a fresh last block), stores
    # left unfinished for a while, pinned and protected blocks, failed stores. With
    # ``renumber``, the clock is rebased every few ticks and the logs renumbered every few
    # dozen entries (both rare at full scale).
    rng = random.Random(seed)
    capacity = rng.choice([4, 9, 16])
    policy = (
        _fixed_weight(weight, span=rng.randrange(1, 40), tokens=rng.randrange(60, 120))
        if renumber
        else _fixed_weight(weight)
    )(capacity)
    model = _OrderedDictALRU(capacity, weight)
    blocks: dict[OffloadKey, BlockStatus] = {}
    writing: list[OffloadKey] = []
    for step in range(250):
        base = 1000 * rng.randrange(4)
        length = rng.randrange(1, 7)
        request = [key(base + i) for i in range(length)]
        if rng.random() < 0.5:
            request[-1] = key(100_000 + step)  # a last block the next turn rewrites
        policy.touch(request)
        model.touch(request)
        op = rng.random()
        if op < 0.15 and writing:  # a store finishes, or fails
            k = writing.pop(rng.randrange(len(writing)))
            if rng.random() < 0.2:
                policy.remove(k)
                model.remove(k)
                del blocks[k]
            else:
                blocks[k].ref_cnt = 0
        elif op < 0.2:  # a load pins a block, or ends
            for block in blocks.values():
                if block.ref_cnt >= 0 and rng.random() < 0.1:
                    block.ref_cnt = 1 if block.ref_cnt == 0 else 0
        new = list(dict.fromkeys(k for k in request if k not in blocks))
        need = len(blocks) + len(new) - capacity
        protected = frozenset(k for k in request if k in blocks and rng.random() < 0.3)
        if need > 0:
            got = policy.evict(need, protected)
            want = model.evict(need, protected)
            assert (None if got is None else [k for k, _ in got]) == want
            if got is None:
                continue
            for k, block in got:
                assert blocks.pop(k) is block
        for k in new:
            block = blocks[k] = BlockStatus(len(blocks))
            policy.insert(k, block)
            model.insert(k, block)
            writing.append(k)
        if rng.random() < 0.5:
            policy.touch(request)  # the touch after a store
            model.touch(request)
        if rng.random() < 0.7:
            for k in writing:
                blocks[k].ref_cnt = 0
            writing.clear()
        state = policy.debug_state()
        assert {name: state[name] for name in model.sizes()} == model.sizes()


class _ModelCopy:
    """One weight miniature as plain structures: per-copy clock and stamps."""

    def __init__(self, weight: float, capacity: int) -> None:
        self.weight, self.capacity = weight, capacity
        self.probation: OrderedDict[OffloadKey, int] = OrderedDict()
        self.main: OrderedDict[OffloadKey, int] = OrderedDict()
        self.ghost: OrderedDict[OffloadKey, None] = OrderedDict()
        self.main_ghost: OrderedDict[OffloadKey, None] = OrderedDict()
        self.now = 0
        self.hits = 0.0

    def access(self, k: OffloadKey) -> bool:
        self.now += 1
        if k in self.main or k in self.probation:
            self.probation.pop(k, None)
            self.main.pop(k, None)
            self.main[k] = self.now
            return True
        if k in self.ghost or k in self.main_ghost:
            self.ghost.pop(k, None)
            self.main_ghost.pop(k, None)
            self.main[k] = self.now
        else:
            self.probation[k] = self.now
        if len(self.probation) + len(self.main) > self.capacity:
            p = next(iter(self.probation.items()), None)
            m = next(iter(self.main.items()), None)
            if p is not None and (m is None or (self.now - p[1]) * self.weight >= self.now - m[1]):
                del self.probation[p[0]]
                ghosts = self.ghost
                gone = p[0]
            else:
                assert m is not None
                del self.main[m[0]]
                ghosts = self.main_ghost
                gone = m[0]
            ghosts[gone] = None
            if len(ghosts) > self.capacity:
                ghosts.popitem(last=False)
        return False


@pytest.mark.parametrize("native", DUEL_KINDS)
@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 60), min_size=1, max_size=8), min_size=50, max_size=400))
def test_weight_miniatures_sharing_one_clock_score_as_separate_copies(
    native: bool, requests: list[list[int]]
) -> None:
    # Repeated keys within a request included: each access is its own time step.
    weights = (1.0, 4.0, 64.0)
    duel = WeightDuel(16, weights, shadow_blocks=16, decay_every=10**9, native=native)
    copies = [_ModelCopy(w, 16) for w in weights]
    for ids in requests:
        ks = [key(i) for i in ids]
        duel.access(ks)
        for copy in copies:
            score = 0
            for k in reversed(ks):
                score = score + 1 if copy.access(k) else 0
            copy.hits += score
    assert duel.hit_counts() == {c.weight: c.hits for c in copies}
    assert duel.sizes() == [len(c.probation) + len(c.main) for c in copies]


@needs_native_duel
@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 40),
    weights=st.lists(
        st.sampled_from([1.0, 1.5, 2.0, 4.0, 8.0, 16.0, 64.0]), min_size=1, max_size=6
    ),
    decay_every=st.integers(1, 50),
    requests=st.lists(
        st.lists(st.integers(0, 120), min_size=1, max_size=12), min_size=1, max_size=600
    ),
)
def test_the_native_weight_miniatures_choose_as_the_compiled_ones(
    capacity: int, weights: list[float], decay_every: int, requests: list[list[int]]
) -> None:
    # The C copies must be the same simulation: the same weight after every request (ties
    # included: the first best copy wins), the same decayed hit counts and sizes.
    duels = [
        WeightDuel(capacity, weights, shadow_blocks=capacity, decay_every=decay_every, native=n)
        for n in (False, True)
    ]
    assert [d.native for d in duels] == [False, True]
    for ids in requests:
        ks = [key(i) for i in ids]
        for duel in duels:
            duel.access(ks)
        python, native = duels
        assert native.weight == python.weight
        assert native.sizes() == python.sizes()
        assert native.hit_counts() == python.hit_counts()


@needs_native_duel
def test_the_native_miniatures_match_over_a_long_skewed_stream() -> None:
    # Long enough for the logs to grow, compact and wrap many times, and for ids to be
    # freed and reused: a hot set, one-off keys and recurring prefixes, as in the traces.
    rng = random.Random(7)
    duels = [
        WeightDuel(2000, (1.0, 2.0, 4.0, 8.0, 16.0, 64.0), shadow_blocks=200, native=n)
        for n in (False, True)
    ]
    weights_seen = set()
    for step in range(6000):
        doc = rng.randrange(400) if rng.random() < 0.7 else 400 + step
        ks = [key(1000 * doc + i) for i in range(rng.randrange(1, 20))]
        for duel in duels:
            duel.access(ks)
        python, native = duels
        assert native.weight == python.weight, step
        weights_seen.add(native.weight)
    assert native.hit_counts() == python.hit_counts()
    assert native.sizes() == python.sizes()
    assert native.id_slots() <= 6 * 3 * 200 + 20
    assert len(weights_seen) > 1  # the stream moves the choice: the test compares decisions


def test_asking_for_missing_native_miniatures_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_mini_sim, "_NativeDuel", None)
    assert not _mini_sim.native_duel_available()
    assert not WeightDuel(100, (1.0, 4.0)).native  # the default falls back
    with pytest.raises(RuntimeError, match="not built"):
        WeightDuel(100, (1.0, 4.0), native=True)


def test_one_crc_draws_both_the_duel_and_the_race_sample() -> None:
    ks = [key(i) for i in range(5000)]
    blocks = {ks[3]: BlockStatus(0)}  # being written: out of the duel's sample, not the race's
    duel = WeightDuel(4000, (1.0, 4.0), shadow_blocks=256)
    race = ShadowRace(4000, [("alru", AdaptiveLRUCachePolicy)], shadow_blocks=256)
    out: list[OffloadKey] = []
    assert duel.sample_with(ks, blocks, race.threshold, out) == duel.sample(ks, blocks)
    assert out == race.sample(ks)
    assert out and len(out) < len(ks)


@pytest.mark.parametrize("capacity", [40, 400])
def test_adaptive_decides_the_same_with_and_without_the_shared_crc(capacity: int) -> None:
    rng = random.Random(capacity)
    requests = [
        [key(1000 * rng.randrange(30) + i) for i in range(rng.randrange(1, 12))]
        for _ in range(3000)
    ]
    runs = []
    for share in (True, False):
        manager = CPUOffloadingManager(capacity, "adaptive")
        policy = manager.policy
        assert isinstance(policy, AdaptiveCachePolicy)
        if not share:
            live = policy._live  # type: ignore[attr-defined]
            assert isinstance(live, AdaptiveLRUCachePolicy)
            live.share_hash(-1)
        hits = 0
        for request in requests:
            k = 0
            while k < len(request) and manager.lookup(request[k]) is True:
                k += 1
            hits += k
            manager.touch(request)
            if k:
                manager.prepare_load(request[:k])
                manager.complete_load(request[:k])
            out = manager.prepare_store(request[k:]) if k < len(request) else None
            if out is not None and out.keys_to_store:
                manager.complete_store(out.keys_to_store)
        state = policy.debug_state()
        runs.append((hits, state["scores"], state["switches"], state["live"]))
    assert runs[0] == runs[1]


def test_adaptive_and_its_live_alru_share_one_block_table_across_switches() -> None:
    # While the adaptive LRU serves, the adaptive policy's table is its table (one dict to
    # update per store and eviction); a switch drains it on a copy, so the table keeps
    # every block, and serving with the adaptive LRU again shares the table again.
    policy = AdaptiveCachePolicy(8)
    table = policy.block_table()
    for i in range(12):
        if len(policy) >= 8:
            victims = policy.evict(1, frozenset())
            assert victims is not None and victims[0][0] not in table
        block = BlockStatus(i)
        policy.insert_many([(key(i), block)])
        block.ref_cnt = 0
        policy.touch([key(i)])
    policy.remove(key(11))
    live = policy._live  # type: ignore[attr-defined]
    assert isinstance(live, AdaptiveLRUCachePolicy) and live.block_table() is table
    before = dict(table)
    for name in ("lru2", "alru"):
        policy._switch(name)  # type: ignore[attr-defined]
        assert policy.block_table() is table and table == before
        assert dict(policy._live.block_table()) == before  # type: ignore[attr-defined]
    assert policy._live.block_table() is table  # type: ignore[attr-defined]
    assert len(policy) == len(before) == 7


def test_a_cache_no_larger_than_its_miniatures_samples_every_key_without_hashing() -> None:
    ks = [key(i) for i in range(300)]
    writing = BlockStatus(0)  # ref_cnt -1: a store just prepared is not an access
    duel = WeightDuel(200, (1.0, 4.0), shadow_blocks=256)
    race = ShadowRace(200, [("alru", AdaptiveLRUCachePolicy)], shadow_blocks=256)
    assert duel.rate == race.rate == 1.0
    assert duel.sample(ks, {ks[5]: writing}) == ks[:5] + ks[6:]
    assert race.sample(ks + ks[:3]) == ks


def test_a_capacity_beyond_the_marks_token_bits_is_refused() -> None:
    # Each log entry's token sits in 27 bits of the block's mark.
    AdaptiveLRUCachePolicy(1 << 25)
    with pytest.raises(ConfigError, match="at most"):
        AdaptiveLRUCachePolicy((1 << 25) + 1)
