"""Value types of the async core, shared by the engine, the HTTP layer and the client.

They are also the HTTP API's response shapes: ``aio/wire.py`` turns them into JSON and back,
and the OpenAPI document shows their schema, with offload keys as hex (:data:`HexKey`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated

from pydantic import ConfigDict, PlainSerializer, PlainValidator, WithJsonSchema

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.events.records import EngineEvent, EventType, GapMarker
from kvcache_offload.kv_events.stats import KVEventStats
from kvcache_offload.tiers.base import TIER_LATENCY_BUCKETS_S, LatencyHistogram, TierStats

__all__ = [
    "HEX_KEY_PATTERN",
    "TRANSFER_DURATION_BUCKETS_S",
    "EngineEvent",
    "EngineStats",
    "EventType",
    "GapMarker",
    "HexKey",
    "Histogram",
    "KeyState",
    "LoadLease",
    "LoadResult",
    "LookupResult",
    "StoreLease",
    "StoreResult",
]


HEX_KEY_PATTERN = r"^(?:[0-9a-fA-F]{2}){5,132}$"
"""An offload key on the wire: hex of the block hash bytes + the 4-byte group index."""


def _key_from_hex(value: object) -> OffloadKey:
    if isinstance(value, bytes):
        return OffloadKey(value)
    if isinstance(value, str):
        try:
            return OffloadKey(bytes.fromhex(value))
        except ValueError:
            pass
    raise ValueError(f"an offload key is a hex string, got {str(value)[:40]!r}")


HexKey = Annotated[
    OffloadKey,
    PlainValidator(_key_from_hex),
    PlainSerializer(bytes.hex, return_type=str),
    WithJsonSchema(
        {
            "type": "string",
            "pattern": HEX_KEY_PATTERN,
            "description": "Offload key as hex: block hash bytes + 4-byte big-endian group index.",
        }
    ),
]
"""An :class:`OffloadKey` in Python, a hex string in JSON (requests, responses, OpenAPI)."""


class WireShape:
    """Base of the HTTP API's response shapes: their field docstrings become the field
    descriptions in the OpenAPI document."""

    __pydantic_config__ = ConfigDict(use_attribute_docstrings=True)


class KeyState(StrEnum):
    READY = "ready"
    """Offloaded and loadable."""
    WRITING = "writing"
    """A store is in flight: retry later."""
    ABSENT = "absent"


@dataclass(frozen=True)
class LookupResult(WireShape):
    """Outcome of a prefix lookup.

    ``hits`` is the length of the longest prefix of ready keys. ``pending`` is vLLM's "retry
    later": a key inside the prefix (before the first absent key) is still being written,
    so a scheduler should defer the request rather than load a shorter prefix.
    """

    hits: int
    """Length of the longest prefix of ready keys."""
    pending: bool
    """A key inside the prefix is being written: retry later."""
    states: list[KeyState]
    tiers: list[str | None] | None = None
    """With secondary tiers configured: where each key in ``states`` is ("CPU", "disk",
    "redis"), None when nowhere ready. A key below the CPU tier is READY: a load promotes it."""
    keys: list[HexKey] | None = None
    """The keys looked up, when the service derived them from token ids (else None)."""


@dataclass(frozen=True)
class StoreResult(WireShape):
    """Blocks written through the manager (``PUT /v1/blocks``, ``write_blocks``)."""

    keys_stored: list[HexKey]
    """Keys actually written by this call (keys already offloaded are skipped)."""
    evicted_keys: list[HexKey]
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0


@dataclass(frozen=True)
class LoadResult:
    keys_loaded: list[OffloadKey]
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0


_new_object = object.__new__


def job_store_result(
    keys_stored: list[OffloadKey], evicted_keys: list[OffloadKey], nbytes: int, seconds: float
) -> StoreResult:
    """``StoreResult(keys_stored, evicted_keys, nbytes, seconds)`` without the frozen
    ``__init__`` (one ``object.__setattr__`` per field, ~1 us): one per store job."""
    result = _new_object(StoreResult)
    fields = result.__dict__
    fields["keys_stored"] = keys_stored
    fields["evicted_keys"] = evicted_keys
    fields["transfer_bytes"] = nbytes
    fields["transfer_seconds"] = seconds
    return result


def job_load_result(keys_loaded: list[OffloadKey], nbytes: int, seconds: float) -> LoadResult:
    """``LoadResult(keys_loaded, nbytes, seconds)`` without the frozen ``__init__``: one per
    load job."""
    result = _new_object(LoadResult)
    fields = result.__dict__
    fields["keys_loaded"] = keys_loaded
    fields["transfer_bytes"] = nbytes
    fields["transfer_seconds"] = seconds
    return result


@dataclass(frozen=True)
class StoreLease(WireShape):
    """A prepared store that the client completes itself (sidecar mode)."""

    lease_id: str
    keys_to_store: list[HexKey]
    block_ids: list[int]
    """CPU slot ids, co-indexed with ``keys_to_store``."""
    evicted_keys: list[HexKey]
    expires_at: float
    """Unix time after which the store is rolled back as failed."""


@dataclass(frozen=True)
class LoadLease(WireShape):
    """A prepared load: the blocks stay pinned until the client completes it or it expires."""

    lease_id: str
    keys: list[HexKey]
    """The keys pinned for reading."""
    block_ids: list[int]
    """CPU slot ids to read from, co-indexed with ``keys``."""
    expires_at: float
    """Unix time after which the pins are released."""


TRANSFER_DURATION_BUCKETS_S: tuple[float, ...] = TIER_LATENCY_BUCKETS_S


@dataclass
class Histogram(LatencyHistogram):
    """The engine's transfer-duration histogram: the tiers' fixed-bucket one, exported as
    Prometheus (cumulative) buckets."""

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound as text, cumulative count) pairs ending with "+Inf"."""
        out, running = [], 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out


@dataclass
class EngineStats(WireShape):
    """Everything /metrics and /v1/stats export; counters are cumulative since start."""

    policy: str
    capacity_blocks: int
    blocks_free: int
    blocks_writing: int
    blocks_idle: int
    blocks_reading: int
    block_nbytes: int = 0
    """Bytes of one offloaded block (one CPU slot): the page size of PUT/GET /v1/blocks."""
    blocks_fenced: int = 0
    """Slots of expired or reset sidecar leases held out of use for the grace period."""
    lookups: int = 0
    """Lookup calls."""
    lookup_keys: int = 0
    """Keys those calls named."""
    lookup_hit_blocks: int = 0
    """Keys found in the ready prefix of a lookup."""
    store_blocks_prepared: int = 0
    """Blocks given a CPU slot by a store (direct or a sidecar lease)."""
    store_blocks_completed: int = 0
    """Blocks whose store completed: loadable now."""
    store_blocks_failed: int = 0
    """Blocks whose store did not complete and was rolled back."""
    stores_rejected: int = 0
    """Store calls the manager refused (no room it could make)."""
    load_blocks_completed: int = 0
    """Blocks loaded (or read by a sidecar lease) and unpinned."""
    load_blocks_failed: int = 0
    """Blocks whose load transfer failed (they were unpinned, the caller got TransferError)."""
    evicted_blocks: int = 0
    """Blocks the eviction policy dropped to make room."""
    evicted_ahead_blocks: int = 0
    """Of ``evicted_blocks``, those that took a block the policy had chosen ahead, behind a
    lone store's copy (``OffloadConfig.transfer.evict_ahead_fraction``)."""
    discarded_blocks: int = 0
    """Blocks freed because a caller said nobody needs them again (``discard``)."""
    released_evictions: int = 0
    """Evictions that took a block a caller had released (``release``) before asking the
    policy; also counted in ``evicted_blocks``."""
    blocks_released: int = 0
    """Blocks released (``release``) and still held: the first to go when room is needed."""
    reuse_filter_skipped_blocks: int = 0
    """Blocks not stored because the reuse filter had not seen them often enough yet."""
    transfer_bytes: dict[str, int] = field(default_factory=dict)
    """By direction: "gpu_to_cpu" (store), "cpu_to_gpu" (load)."""
    transfer_seconds: dict[str, float] = field(default_factory=dict)
    transfer_duration: dict[str, Histogram] = field(default_factory=dict)
    transfers_in_flight: int = 0
    leases_active: int = 0
    leases_expired: dict[str, int] = field(default_factory=dict)
    """By kind: "store", "load"."""
    event_subscribers: int = 0
    """Open event subscriptions and SSE streams."""
    events_published: dict[str, int] = field(default_factory=dict)
    events_dropped: int = 0
    """Events subscribers missed because they fell behind (sum of gap sizes)."""
    last_event_seq: int = 0
    mrc_hit_ratio: dict[float, float] = field(default_factory=dict)
    """Estimated block hit ratio at ``scale`` x the current capacity (miss-ratio curve)."""
    mrc_sampled_keys: int = 0
    observer_dropped_requests: int = 0
    """Requests left out of the estimates (MRC, shadows) to keep them within their budget."""
    kv_events: KVEventStats | None = None
    """Counters of the ZMQ KV-event publisher, None when it is off."""
    tiers: list[TierStats] = field(default_factory=list)
    """Secondary tiers below the CPU tier, in lookup order (empty when none is configured)."""
    tier_write_queue_depth: int = 0
    tier_write_queue_full_blocks: int = 0
    """Blocks whose tier write was dropped because the write queue was full (each tier's
    ``writes_dropped`` counts them too, with its own back-off and failed writes)."""
    tier_write_backpressure_waits: int = 0
    """Stores that waited for room in the write queue (``tier_write_backpressure``)."""
    tier_write_backpressure_timeouts: int = 0
    """Of those, stores whose wait timed out (their write was dropped if still no room)."""
    tier_promoted_blocks: int = 0
    """Blocks copied up from a secondary tier into CPU slots for a load."""
    shadow_live_policy: str = ""
    """The live policy's name among the shadow candidates ("" when shadows are off)."""
    shadow_hit_blocks: dict[str, int] = field(default_factory=dict)
    """By candidate policy: sampled blocks it would have hit (shadow simulation)."""
    shadow_sampled_blocks: int = 0
    """Sampled blocks looked up, the denominator of every candidate's shadow hit ratio."""
