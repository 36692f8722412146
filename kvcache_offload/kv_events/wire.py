"""vLLM's KV-event wire format: msgpack ``KVEventBatch``es of tagged block events.

One ZMQ message is three frames: the topic (UTF-8), the batch sequence number (8 bytes,
big-endian, first batch 0) and the msgpack payload. The payload is a ``KVEventBatch`` encoded
as a msgpack array ``[ts, events, data_parallel_rank]`` (ts: float64 Unix seconds). Each event
is a msgspec *tagged* struct whose tag is its class name. Two event encodings exist, because
vLLM changed its own in 2026 (PR #42892, first released after v0.23):

* ``"array"`` (vLLM <= 0.23, the issue's "array-like"): an event is the array
  ``[tag, field1, field2, ...]`` in the field order below; every field is written, defaults too.
* ``"map"`` (vLLM >= 0.24): an event is a map ``{"type": tag, "field": value, ...}``; fields
  whose value equals their default (``None``) are left out.

Event fields, in order (``Hash`` is an unsigned 64-bit int or a byte string):

* ``BlockStored``: block_hashes: list[Hash], parent_block_hash: Hash | None,
  token_ids: list[int], block_size: int, lora_id: int | None, medium: str | None,
  lora_name: str | None, extra_keys: list | None = None, group_idx: int | None = None
* ``BlockRemoved``: block_hashes: list[Hash], medium: str | None, group_idx: int | None = None
* ``AllBlocksCleared``: no fields

The replay channel answers an 8-byte big-endian start sequence number with one
``[seq, payload]`` message per buffered batch with ``seq >= start`` and then
``[END_SEQ, b""]`` (``END_SEQ`` is -1 as a signed 64-bit big-endian integer).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

__all__ = [
    "END_SEQ",
    "Encoding",
    "HashFormat",
    "WireCodec",
    "external_block_hash",
    "seq_bytes",
]

Encoding = Literal["array", "map"]
HashFormat = Literal["int", "bytes"]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""Sequence frame of the replay channel's end marker (its payload frame is empty)."""

_U64 = (1 << 64) - 1
_Hash = int | bytes

_STORED_FIELDS: list[tuple[str, Any] | tuple[str, Any, Any]] = [
    ("block_hashes", list[_Hash]),
    ("parent_block_hash", _Hash | None),
    ("token_ids", list[int]),
    ("block_size", int),
    ("lora_id", int | None),
    ("medium", str | None),
    ("lora_name", str | None),
    ("extra_keys", list[Any] | None, None),
    ("group_idx", int | None, None),
]
_REMOVED_FIELDS: list[tuple[str, Any] | tuple[str, Any, Any]] = [
    ("block_hashes", list[_Hash]),
    ("medium", str | None),
    ("group_idx", int | None, None),
]


def _event_types(array_like: bool) -> tuple[type[Any], type[Any], type[Any], type[Any]]:
    """(BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch) for one event encoding."""
    options: dict[str, Any] = {"omit_defaults": True, "gc": False, "array_like": array_like}
    stored = msgspec.defstruct("BlockStored", _STORED_FIELDS, tag=True, **options)
    removed = msgspec.defstruct("BlockRemoved", _REMOVED_FIELDS, tag=True, **options)
    cleared = msgspec.defstruct("AllBlocksCleared", [], tag=True, **options)
    event = stored | removed | cleared
    batch = msgspec.defstruct(
        "KVEventBatch",
        [("ts", float), ("events", list[event]), ("data_parallel_rank", int | None, None)],  # type: ignore[valid-type]
        omit_defaults=True,
        gc=False,
        array_like=True,
    )
    return stored, removed, cleared, batch


_TYPES: dict[str, tuple[type[Any], type[Any], type[Any], type[Any]]] = {
    "array": _event_types(array_like=True),
    "map": _event_types(array_like=False),
}


def external_block_hash(block_hash: bytes, fmt: HashFormat) -> int | bytes:
    """A block hash as vLLM publishes it: its low 64 bits as an unsigned int, or the bytes.

    vLLM's default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) is the int: the hash bytes
    read big-endian, masked to 64 bits, i.e. the last 8 bytes.
    """
    if fmt == "bytes":
        return bytes(block_hash)
    return int.from_bytes(block_hash[-8:], "big") & _U64


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


class WireCodec:
    """Builds and encodes events and batches in one event encoding."""

    def __init__(self, encoding: Encoding = "array", data_parallel_rank: int = 0) -> None:
        if encoding not in _TYPES:
            raise ValueError(f"encoding must be 'array' or 'map', got {encoding!r}")
        self.encoding = encoding
        self.data_parallel_rank = data_parallel_rank
        self._stored, self._removed, self._cleared, self._batch = _TYPES[encoding]
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(self._batch)

    def stored(
        self,
        block_hashes: list[int | bytes],
        *,
        parent_block_hash: int | bytes | None,
        token_ids: list[int],
        block_size: int,
        medium: str | None,
        group_idx: int | None,
        lora_id: int | None = None,
        lora_name: str | None = None,
    ) -> Any:
        # Positional, in the documented field order (extra_keys is never set).
        return self._stored(
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            medium,
            lora_name,
            None,
            group_idx,
        )

    def removed(
        self, block_hashes: list[int | bytes], *, medium: str | None, group_idx: int | None
    ) -> Any:
        return self._removed(block_hashes, medium, group_idx)

    def cleared(self) -> Any:
        return self._cleared()

    def encode_batch(self, events: Sequence[Any], ts: float | None = None) -> bytes:
        """The msgpack payload of one batch (``ts`` defaults to now)."""
        batch = self._batch(
            ts=time.time() if ts is None else ts,
            events=list(events),
            data_parallel_rank=self.data_parallel_rank,
        )
        return self._encoder.encode(batch)

    def decode_batch(self, payload: bytes) -> Any:
        """The inverse of :meth:`encode_batch` (for tests and tools)."""
        return self._decoder.decode(payload)
