"""Turn a request's key source (hex keys or token ids) into offload keys, within limits.

Parsing a large body and hashing its token ids can take seconds of CPU: bodies over
``OFF_LOOP_BYTES`` are parsed and hashed in a worker thread (:func:`parse_keys`), their token
ids decoded in short steps that let the event loop take the GIL in between
(``api/routes/_token_body.py``), so it keeps answering other requests (and ``/healthz``).
Such bodies keep their token ids as one numpy int64 array in ``body.token_ids``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

import anyio
import numpy as np

from kvcache_offload.contracts.manager import ReqContext
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.keys import token_block_keys
from kvcache_offload.kv_events.block_tokens import token_blocks

from ..limits import RequestLimitError, check_key_count
from ..schemas import KeysRequest
from ._body import validate_body
from ._token_body import FRAME_BYTES, decode_token_ids, split_token_ids

if TYPE_CHECKING:
    from kvcache_offload.aio.engine import OffloadEngine

__all__ = [
    "OFF_LOOP_BYTES",
    "hex_keys",
    "parse_keys",
    "remember_block_tokens",
    "request_context",
    "resolve_keys",
]

K = TypeVar("K", bound=KeysRequest)

OFF_LOOP_BYTES = 64 * 1024
"""Bodies larger than this are parsed and hashed off the event loop (64 hex keys: ~2 KiB)."""
OFF_LOOP_TOKENS = 65_536
"""Token ids above which the KV-event publisher's Python ints are made off the event loop."""


def _parse_and_resolve(raw: bytes, model: type[K], max_keys: int) -> tuple[K, list[OffloadKey]]:
    body = validate_body(raw, model)
    return body, resolve_keys(body, max_keys)


KEY_JSON_BYTES = 128
"""Generous JSON size of one hex key (72 hex digits, quotes, comma, spaces)."""


def _parse_large(raw: bytes, model: type[K], max_keys: int) -> tuple[K, list[OffloadKey]]:
    split = split_token_ids(raw)
    if split is not None:
        rest, start, end = split
        body = validate_body(rest, model)  # every field but the ids, as a small body
        if body.token_ids is not None and len(body.token_ids) == 0:
            tokens = decode_token_ids(raw, start, end)
            body = body.model_copy(update={"token_ids": tokens})
            return body, resolve_keys(body, max_keys)
    # Parsed in one call (holding the GIL): only as large as max_keys_per_request keys need.
    limit = max_keys * KEY_JSON_BYTES + FRAME_BYTES
    if len(raw) > limit:
        raise RequestLimitError(
            413,
            f"request body of {len(raw)} bytes is larger than {max_keys} keys need (at most "
            f"{limit}); send token ids as a top-level 'token_ids' array with the other fields "
            f"under {FRAME_BYTES} bytes",
        )
    return _parse_and_resolve(raw, model, max_keys)


async def parse_keys(raw: bytes, model: type[K], max_keys: int) -> tuple[K, list[OffloadKey]]:
    """The validated body and its keys; large bodies are handled in a worker thread."""
    if len(raw) <= OFF_LOOP_BYTES:
        return _parse_and_resolve(raw, model, max_keys)
    return await anyio.to_thread.run_sync(_parse_large, raw, model, max_keys)


def resolve_keys(body: KeysRequest, max_keys: int) -> list[OffloadKey]:
    """Keys named by ``body``; refuses more than ``max_keys`` before deriving anything."""
    if body.keys is not None:
        check_key_count(len(body.keys), max_keys)
        return [OffloadKey(bytes.fromhex(k)) for k in body.keys]
    assert body.token_ids is not None and body.block_size is not None  # by the schema
    check_key_count(len(body.token_ids) // body.block_size, max_keys)
    return token_block_keys(body.token_ids, body.block_size, body.group_idx, body.salt)


def request_context(body: KeysRequest) -> ReqContext | None:
    return ReqContext(req_id=body.req_id) if body.req_id else None


def hex_keys(keys: list[OffloadKey]) -> list[str]:
    return [k.hex() for k in keys]


async def remember_block_tokens(
    engine: OffloadEngine, body: KeysRequest, keys: list[OffloadKey]
) -> None:
    """Hand the tokens behind token-derived keys to the KV-event publisher, when there is one.

    Its ``BlockStored`` events then carry the tokens routers hash (docs/kv-events.md). The ids
    of a large body (a numpy array) become Python ints in a worker thread, a slice at a time:
    4M of them at once held the event loop for 130-180 ms.
    """
    publisher = engine.kv_events
    if publisher is None or body.token_ids is None or body.block_size is None:
        return
    if isinstance(body.token_ids, np.ndarray) and body.token_ids.size > OFF_LOOP_TOKENS:
        blocks = await anyio.to_thread.run_sync(
            token_blocks, body.token_ids, body.block_size, len(keys)
        )
        publisher.remember_token_blocks(keys, blocks, body.block_size)
    else:
        publisher.remember_tokens(keys, body.token_ids, body.block_size)
