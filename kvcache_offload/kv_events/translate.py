"""Engine events -> vLLM KV events: which offload keys become which block hashes.

* ``stored`` -> ``BlockStored``, ``evicted`` -> ``BlockRemoved``, ``reset`` ->
  ``AllBlocksCleared``; the other engine events (loads, failures, lease expiry) change nothing
  a router indexes and are not published.
* An offload key is ``block_hash || group_idx (4 bytes, big-endian)``, the layout of vLLM's
  ``BlockHashWithGroupId``; the hash part is published in vLLM's external form
  (:func:`~kvcache_offload.kv_events.wire.external_block_hash`) and the group as ``group_idx``.
  Keys of one engine event are split by group, keeping their order.
* ``medium`` is the engine event's tier ("CPU", ...) renamed through ``media`` (a router may
  spell tiers its own way, e.g. Dynamo's "CPU_TIER1").
* A stored block whose tokens are known (:class:`BlockTokens`) is published with its tokens,
  its block size and its parent's hash; consecutive blocks of one chain share one
  ``BlockStored``. Blocks without known tokens are published with ``token_ids=[]``, no parent
  and the tier's block size in tokens, as vLLM's own offloading connector does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.events.records import EngineEvent, EventType
from kvcache_offload.kv_events.block_tokens import BlockTokenEntry, BlockTokens
from kvcache_offload.kv_events.wire import HashFormat, WireCodec, external_block_hash

__all__ = ["PUBLISHED_TYPES", "EventTranslator", "split_key"]

PUBLISHED_TYPES = (EventType.STORED, EventType.EVICTED, EventType.RESET)
_STORED, _EVICTED, _RESET = PUBLISHED_TYPES


def split_key(key: OffloadKey) -> tuple[bytes, int]:
    """(block hash, group index) of an offload key; keys of 4 bytes or less are group 0."""
    if len(key) <= 4:
        return bytes(key), 0
    return bytes(key[:-4]), int.from_bytes(key[-4:], "big")


class EventTranslator:
    """Turns one :class:`EngineEvent` into the wire events a router consumes."""

    def __init__(
        self,
        codec: WireCodec,
        *,
        hash_format: HashFormat = "int",
        block_sizes: Sequence[int] = (16,),
        media: Mapping[str, str] | None = None,
        tokens: BlockTokens | None = None,
    ) -> None:
        if not block_sizes:
            raise ValueError("block_sizes must name at least one group")
        self.codec = codec
        self.hash_format: HashFormat = hash_format
        self.block_sizes = tuple(block_sizes)
        self.media = dict(media or {})
        self.tokens = tokens if tokens is not None else BlockTokens()

    def _hash(self, key: OffloadKey) -> int | bytes:
        if self.hash_format == "int" and len(key) > 4:
            # The hash part's last 8 bytes (all of it when shorter): vLLM's low 64 bits.
            return int.from_bytes(key[-12:-4], "big")
        return external_block_hash(split_key(key)[0], self.hash_format)

    def translate(self, event: EngineEvent) -> list[Any]:
        kind, keys = event.type, event.keys
        if kind is _RESET:
            # The token memory stays: it may already hold tokens of stores made after the reset.
            return [self.codec.cleared()]
        if kind is not _STORED and kind is not _EVICTED:
            return []
        medium = self.media.get(event.medium, event.medium)
        if len(keys) == 1 and (kind is _EVICTED or not self.tokens):
            return [self._single(kind, keys[0], medium)]  # the common case, kept short
        if kind is _STORED:
            return self._stored(keys, medium)
        return [
            self.codec.removed([self._hash(k) for k in group_keys], medium=medium, group_idx=g)
            for g, group_keys in _by_group(keys).items()
        ]

    def _single(self, kind: EventType, key: OffloadKey, medium: str) -> Any:
        group = int.from_bytes(key[-4:], "big") if len(key) > 4 else 0
        if kind is _EVICTED:
            return self.codec.removed([self._hash(key)], medium=medium, group_idx=group)
        sizes = self.block_sizes
        return self.codec.stored(
            [self._hash(key)],
            parent_block_hash=None,
            token_ids=[],
            block_size=sizes[group] if group < len(sizes) else sizes[0],
            medium=medium,
            group_idx=group,
        )

    def _stored(self, keys: list[OffloadKey], medium: str) -> list[Any]:
        if not self.tokens:  # no tokens remembered: one event per group, no chain
            sizes, stored, hash_of = self.block_sizes, self.codec.stored, self._hash
            return [
                stored(
                    [hash_of(k) for k in group_keys],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=sizes[group] if group < len(sizes) else sizes[0],
                    medium=medium,
                    group_idx=group,
                )
                for group, group_keys in _by_group(keys).items()
            ]
        out: list[Any] = []
        for group, group_keys in _by_group(keys).items():
            sizes = self.block_sizes
            default_size = sizes[group] if group < len(sizes) else sizes[0]
            run: list[tuple[OffloadKey, BlockTokenEntry | None]] = []
            for key in group_keys:
                entry = self.tokens.take(key)
                if run and not _continues(run[-1], key, entry):
                    out.append(self._stored_run(run, medium, group, default_size))
                    run = []
                run.append((key, entry))
            if run:
                out.append(self._stored_run(run, medium, group, default_size))
        return out

    def _stored_run(
        self,
        run: list[tuple[OffloadKey, BlockTokenEntry | None]],
        medium: str,
        group: int,
        default_size: int,
    ) -> Any:
        first = run[0][1]
        hashes = [self._hash(k) for k, _ in run]
        if first is None:
            return self.codec.stored(
                hashes,
                parent_block_hash=None,
                token_ids=[],
                block_size=default_size,
                medium=medium,
                group_idx=group,
            )
        token_ids: list[int] = []
        for _, entry in run:  # a run never mixes known and unknown tokens
            if entry is not None:
                token_ids.extend(entry.token_ids)
        return self.codec.stored(
            hashes,
            parent_block_hash=None if first.parent is None else self._hash(first.parent),
            token_ids=token_ids,
            block_size=first.block_size,
            medium=medium,
            group_idx=group,
        )


def _continues(
    last: tuple[OffloadKey, BlockTokenEntry | None], key: OffloadKey, entry: BlockTokenEntry | None
) -> bool:
    """Whether ``key`` extends the run ending in ``last`` (same token knowledge, same chain)."""
    last_key, last_entry = last
    if last_entry is None or entry is None:
        return last_entry is None and entry is None
    return entry.parent == last_key and entry.block_size == last_entry.block_size


def _by_group(keys: list[OffloadKey]) -> dict[int, list[OffloadKey]]:
    groups: dict[int, list[OffloadKey]] = {}
    for key in keys:
        group = int.from_bytes(key[-4:], "big") if len(key) > 4 else 0
        if group in groups:
            groups[group].append(key)
        else:
            groups[group] = [key]
    return groups
