"""KV events for cache-aware routers, in vLLM's ZMQ wire format (see ``docs/kv-events.md``)."""

from kvcache_offload.kv_events.block_tokens import BlockTokenEntry, BlockTokens, token_blocks
from kvcache_offload.kv_events.publisher import KVEventPublisher
from kvcache_offload.kv_events.stats import KVEventStats
from kvcache_offload.kv_events.translate import PUBLISHED_TYPES, EventTranslator, split_key
from kvcache_offload.kv_events.wire import (
    END_SEQ,
    Encoding,
    HashFormat,
    WireCodec,
    external_block_hash,
)

__all__ = [
    "END_SEQ",
    "PUBLISHED_TYPES",
    "BlockTokenEntry",
    "BlockTokens",
    "Encoding",
    "EventTranslator",
    "HashFormat",
    "KVEventPublisher",
    "KVEventStats",
    "WireCodec",
    "external_block_hash",
    "split_key",
    "token_blocks",
]
