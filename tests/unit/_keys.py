"""Test helpers: keys named by small integers, like vLLM's own tests."""

from __future__ import annotations

from collections.abc import Iterable

from kvcache_offload import OffloadKey, make_offload_key


def key(i: int) -> OffloadKey:
    return make_offload_key(str(i).encode(), 0)


def keys(*ids: int) -> list[OffloadKey]:
    return [key(i) for i in ids]


def key_ids(ks: Iterable[OffloadKey]) -> list[int]:
    return [int(k[:-4]) for k in ks]
