"""A straightforward manager with vLLM's classic (v0.1x "A") behaviour: the benchmark baseline.

Written from the behaviour specification (``../shared/reference/vllm-kv-offload.md`` section 3),
not from vLLM's code, and kept deliberately plain the way the classic version is: block states
are ``ctypes`` structures, every prepare call builds a numpy id array, LRU eviction scans from
the least recent end, ARC eviction rescans from the head for every victim and fails when T2 has
no evictable block while T1 is below its target (the defect fixed upstream by #55461). It lets
``bench/manager.py`` report a speed-up measured in the same run on the same machine.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from kvcache_offload.contracts.load_store_spec import CPULoadStoreSpec
from kvcache_offload.contracts.manager import (
    PrepareStoreOutput,
    ReqContext,
)


class _Block(ctypes.Structure):
    _fields_ = [("ref_cnt", ctypes.c_int32), ("block_id", ctypes.c_int64)]

    def __init__(self, block_id: int) -> None:
        super().__init__(ref_cnt=-1, block_id=block_id)


class _LRU:
    def __init__(self, capacity: int) -> None:
        self.blocks: OrderedDict[bytes, _Block] = OrderedDict()

    def get(self, key: bytes) -> _Block | None:
        return self.blocks.get(key)

    def insert(self, key: bytes, block: _Block) -> None:
        self.blocks[key] = block

    def touch(self, keys: Iterable[bytes]) -> None:
        for key in reversed(list(keys)):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, _Block]] | None:
        if n == 0:
            return []
        victims = []
        for key, block in self.blocks.items():
            if block.ref_cnt == 0 and key not in protected:
                victims.append((key, block))
                if len(victims) == n:
                    break
        if len(victims) < n:
            return None
        for key, _ in victims:
            del self.blocks[key]
        return victims


class _ARC:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.p = 0.0
        self.t1: OrderedDict[bytes, _Block] = OrderedDict()
        self.t2: OrderedDict[bytes, _Block] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()

    def get(self, key: bytes) -> _Block | None:
        block = self.t1.get(key)
        return block if block is not None else self.t2.get(key)

    def insert(self, key: bytes, block: _Block) -> None:
        self.t1[key] = block
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def touch(self, keys: Iterable[bytes]) -> None:
        for key in reversed(list(keys)):
            if key in self.t1:
                block = self.t1.pop(key)
                if not block.ref_cnt >= 0:
                    self.t1[key] = block
                else:
                    self.t2[key] = block
            elif key in self.t2:
                self.t2.move_to_end(key)
            elif key in self.b1:
                self.p = min(self.p + max(1, len(self.b2) / len(self.b1)), self.capacity)
                self.b1.move_to_end(key)
            elif key in self.b2:
                self.p = max(self.p - max(1, len(self.b1) / len(self.b2)), 0)
                self.b2.move_to_end(key)

    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, _Block]] | None:
        if n == 0:
            return []
        selected: list[tuple[bytes, _Block, bool]] = []
        chosen: set[bytes] = set()
        virtual_t1 = len(self.t1)
        for _ in range(n):
            victim = None
            if virtual_t1 >= int(self.p):
                for key, block in self.t1.items():
                    if block.ref_cnt == 0 and key not in protected and key not in chosen:
                        victim = (key, block, True)
                        virtual_t1 -= 1
                        break
            if victim is None:
                for key, block in self.t2.items():
                    if block.ref_cnt == 0 and key not in protected and key not in chosen:
                        victim = (key, block, False)
                        break
            if victim is None:
                return None
            selected.append(victim)
            chosen.add(victim[0])
        for key, _, from_t1 in selected:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        for ghosts in (self.b1, self.b2):
            while len(ghosts) > self.capacity:
                ghosts.popitem(last=False)
        return [(key, block) for key, block, _ in selected]


class ClassicCPUManager:
    """The classic CPU manager's call surface (lookup, prepare/complete load and store)."""

    def __init__(self, num_blocks: int, cache_policy: str = "lru") -> None:
        self.num_blocks = num_blocks
        self.num_allocated = 0
        self.free_list: list[int] = []
        self.policy = {"lru": _LRU, "arc": _ARC}[cache_policy](num_blocks)

    def _free_count(self) -> int:
        return len(self.free_list) + self.num_blocks - self.num_allocated

    def lookup(self, key: bytes, req_context: ReqContext | None = None) -> bool | None:
        block = self.policy.get(key)
        if block is None:
            return False
        return block.ref_cnt >= 0 or None

    def prepare_load(
        self, keys: Sequence[bytes], req_context: ReqContext | None = None
    ) -> CPULoadStoreSpec:
        ids = []
        for key in keys:
            block = self.policy.get(key)
            assert block is not None and block.ref_cnt >= 0
            block.ref_cnt += 1
            ids.append(block.block_id)
        return CPULoadStoreSpec(np.array(ids, dtype=np.int64))

    def touch(self, keys: Sequence[bytes], req_context: ReqContext | None = None) -> None:
        self.policy.touch(keys)

    def complete_load(self, keys: Sequence[bytes], req_context: ReqContext | None = None) -> None:
        for key in keys:
            block = self.policy.get(key)
            assert block is not None and block.ref_cnt > 0
            block.ref_cnt -= 1

    def prepare_store(
        self, keys: Sequence[bytes], req_context: ReqContext | None = None
    ) -> PrepareStoreOutput | None:
        keys_to_store = [key for key in keys if self.policy.get(key) is None]
        if not keys_to_store:
            return PrepareStoreOutput([], CPULoadStoreSpec(np.array([], dtype=np.int64)), [])
        evicted_keys: list[bytes] = []
        needed = len(keys_to_store) - self._free_count()
        if needed > 0:
            victims = self.policy.evict(needed, set(keys))
            if victims is None:
                return None
            for key, block in victims:
                self.free_list.append(block.block_id)
                evicted_keys.append(key)
        ids = []
        for key in keys_to_store:
            if self.num_allocated < self.num_blocks:
                block_id = self.num_allocated
                self.num_allocated += 1
            else:
                block_id = self.free_list.pop()
            self.policy.insert(key, _Block(block_id))
            ids.append(block_id)
        return PrepareStoreOutput(
            keys_to_store,  # type: ignore[arg-type]
            CPULoadStoreSpec(np.array(ids, dtype=np.int64)),
            evicted_keys,  # type: ignore[arg-type]
        )

    def complete_store(
        self, keys: Sequence[bytes], req_context: ReqContext | None = None, success: bool = True
    ) -> None:
        for key in keys:
            block = self.policy.get(key)
            if block is not None and block.ref_cnt == -1:
                block.ref_cnt = 0
