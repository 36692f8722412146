"""Turn a request's key source (hex keys or token ids) into offload keys, within limits."""

from __future__ import annotations

from api.limits import check_key_count
from api.schemas import KeysRequest
from kvcache_offload.contracts.manager import ReqContext
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.keys import token_block_keys

__all__ = ["hex_keys", "remember_block_tokens", "request_context", "resolve_keys"]


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


def remember_block_tokens(engine: object, body: KeysRequest, keys: list[OffloadKey]) -> None:
    """Hand the tokens behind token-derived keys to the KV-event publisher, when there is one.

    Its ``BlockStored`` events then carry the tokens routers hash (docs/kv-events.md).
    """
    publisher = getattr(engine, "kv_events", None)
    if publisher is not None and body.token_ids is not None and body.block_size is not None:
        publisher.remember_tokens(keys, body.token_ids, body.block_size)
