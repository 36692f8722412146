"""Recency for the vLLM releases whose scheduler reports a request's end instead of touching.

vLLM 0.21's scheduler calls ``touch`` with a request's keys. Later releases never call it:
their own manager records the keys each request loads or offers to store and refreshes them
all once the request finishes (``on_request_finished``). Our policies learn recency from
``touch``, so without this a prefix loaded again was evicted as if never used (insertion
order). The bridge records the same keys in the request's own context (``ReqContext``'s
scratch space: no table to clean up) and touches them, in prompt order, at the request's end.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvcache_offload.contracts.offload_key import OffloadKey

__all__ = ["RequestKeys", "finish", "record"]


class RequestKeys:
    """The keys one request loaded or offered to store, each once, first use first."""

    __slots__ = ("finished", "keys", "seen")

    def __init__(self) -> None:
        self.keys: list[OffloadKey] = []
        self.seen: set[OffloadKey] = set()
        self.finished = False


def _state(req_context: Any, create: bool) -> RequestKeys | None:
    get_state = getattr(req_context, "get_state", None)
    if get_state is None:  # a context without scratch space: nothing to record in
        return None
    state = get_state(RequestKeys)
    if state is None and create:
        state = RequestKeys()
        req_context.set_state(state)
    return state  # type: ignore[no-any-return]


def record(req_context: Any, keys: Iterable[OffloadKey]) -> None:
    """Note ``keys`` as used by the request of ``req_context``."""
    state = _state(req_context, create=True)
    if state is None or state.finished:
        return
    seen = state.seen
    for key in keys:
        if key not in seen:
            seen.add(key)
            state.keys.append(key)


def finish(req_context: Any) -> list[OffloadKey]:
    """The request's keys in prompt order (by vLLM's recorded positions where every key has
    one, else first use first), once: a second call answers nothing."""
    state = _state(req_context, create=False)
    if state is None or state.finished:
        return []
    state.finished = True
    keys, state.keys, state.seen = state.keys, [], set()
    position = getattr(req_context, "get_offload_key_position", None)
    if position is not None and keys:
        positions = [position(key) for key in keys]
        if None not in positions:
            order = sorted(range(len(keys)), key=positions.__getitem__)
            keys = [keys[i] for i in order]
    return keys
