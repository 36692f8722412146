"""The contract every secondary tier (below the CPU tier) implements, and its statistics.

A secondary tier stores whole offloaded blocks as bytes under their offload key. Every call is
an async batch, so a network tier can answer a batch in one round trip. The contract is small
on purpose: the engine only ever asks "which of these do you hold", "give me these", "keep
these" and "forget these"; capacity and eviction are the tier's own business.

Failure model: a tier raises :class:`~kvcache_offload.errors.TierError` (or lets a timeout
cancel it) when it cannot answer; the :class:`~kvcache_offload.tiers.tier_set.TierSet` above
it turns that into misses and counts it. A value that fails its checks is *not* an error: the
tier reports a miss, removes the value itself and counts it (``corrupt_blocks``); the tier set
adds one check every tier shares, the block's length. A block that one ``put`` could not write
is dropped and counted (``writes_dropped``) without failing the rest of the batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcache_offload.contracts.offload_key import OffloadKey

__all__ = ["TIER_LATENCY_BUCKETS_S", "LatencyHistogram", "SecondaryTier", "TierStats"]

TIER_LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip


@dataclass
class LatencyHistogram:
    """Fixed-bucket latency histogram (non-cumulative counts; the last bucket is +Inf)."""

    bounds: tuple[float, ...] = TIER_LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float) -> None:
        # The first bucket whose bound is >= seconds (bounds ascend); one per transfer job.
        # A NaN lands in the +Inf bucket.
        i = bisect_left(self.bounds, seconds) if seconds == seconds else len(self.bounds)
        self.counts[i] += 1
        self.sum += seconds
        self.count += 1

    def copy(self) -> LatencyHistogram:
        return LatencyHistogram(self.bounds, list(self.counts), self.sum, self.count)


@dataclass
class TierStats:
    """Counters of one secondary tier, as reported by ``/v1/stats`` and ``/metrics``.

    Traffic first (every tier counts it the same way: payload bytes, not frame headers), then
    what the tier holds, which only a tier that owns its storage can say.
    """

    name: str
    kind: str
    available: bool = True
    """False while the tier is backed off after errors or slowness."""
    hits: int = 0
    """Keys a lookup found in this tier (and in no tier above it)."""
    misses: int = 0
    get_blocks: int = 0
    get_bytes: int = 0
    put_blocks: int = 0
    put_bytes: int = 0
    deleted_blocks: int = 0
    evicted_blocks: int = 0
    corrupt_blocks: int = 0
    """Values that failed any check (header, key, checksum, length, not a regular file):
    each one a miss, and removed."""
    errors: int = 0
    writes_dropped: int = 0
    """Blocks not written: the write queue was full, the tier was backed off or slow, or the
    write of that one block failed."""
    op_seconds: dict[str, LatencyHistogram] = field(default_factory=dict)
    """Latency per operation: contains, get, put, delete."""
    capacity_bytes: int | None = None
    blocks: int | None = None
    """Blocks held, where the tier knows (disk); None where the store decides (Redis, shared
    by every instance: its memory is not this instance's)."""
    bytes: int | None = None


class SecondaryTier(ABC):
    """An ordered tier below the CPU tier: disk, Redis/Valkey, ..."""

    name: str
    """Short name used in metrics labels, events (``medium``) and lookup answers."""
    read_timeout_s: float | None = None
    """Deadline of one lookup or read batch of this tier; None: the tier set's own
    (``tier_read_timeout_s``). A tier whose reads move many bytes over a network (the object
    store) sets a longer one."""

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Prepare the tier (scan a directory, ...); must not fail when a server is down."""

    @abstractmethod
    async def contains(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """Whether each key is held (a later ``get`` may still miss: eviction, corruption)."""

    @abstractmethod
    async def get(self, keys: Sequence[OffloadKey]) -> list[bytes | None]:
        """Each key's verified bytes, or None (absent, evicted or corrupt: removed)."""

    @abstractmethod
    async def put(self, items: Sequence[tuple[OffloadKey, bytes]]) -> None:
        """Keep these blocks (a key already held may be kept or overwritten)."""

    @abstractmethod
    async def delete(self, keys: Sequence[OffloadKey]) -> None:
        """Forget these keys; unknown keys are ignored."""

    def take_evicted(self) -> list[OffloadKey]:
        """Keys the tier evicted by itself since the last call (for events); [] if unknown."""
        return []

    @abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of the tier's own counters (the tier set adds its own)."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release connections and files."""
