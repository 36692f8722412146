"""Prometheus families of the secondary tiers (disk, Redis, object store), one label value per tier.

Read from the same ``EngineStats`` snapshot as every other engine metric. Without tiers the
labelled families are exported empty (the contract in docs/metrics.md lists them all).
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import accumulate

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kvcache_offload.aio.types import EngineStats
from kvcache_offload.tiers.base import LatencyHistogram

__all__ = ["tier_families"]

P = "kvcache_offload_tier_"

_COUNTERS = (
    ("hits", "hits", "Lookup keys found in this tier (and in no tier above it)."),
    ("misses", "misses", "Lookup keys this tier did not hold (or could not answer)."),
    ("get_blocks", "get_blocks", "Blocks read from the tier."),
    ("get_bytes", "get_bytes", "Bytes read from the tier."),
    ("put_blocks", "put_blocks", "Blocks written to the tier."),
    ("put_bytes", "put_bytes", "Bytes written to the tier."),
    ("evicted_blocks", "evicted_blocks", "Blocks the tier evicted itself (disk budget)."),
    ("corrupt_blocks", "corrupt_blocks", "Values that failed their checksum: missed, removed."),
    ("errors", "errors", "Failed or timed-out tier calls (each one a miss or dropped write)."),
    ("writes_dropped", "writes_dropped_blocks", "Blocks not written: queue full or backed off."),
)

_ENGINE_SCALARS: tuple[tuple[type[GaugeMetricFamily | CounterMetricFamily], str, str, str], ...] = (
    (GaugeMetricFamily, "write_queue_depth", "tier_write_queue_depth",
     "Write jobs waiting for the tiers."),
    (CounterMetricFamily, "write_queue_full_blocks", "tier_write_queue_full_blocks",
     "Blocks whose tier write was dropped because the write queue was full."),
    (CounterMetricFamily, "write_backpressure_waits", "tier_write_backpressure_waits",
     "Stores that waited for room in the tier write queue (tier_write_backpressure)."),
    (CounterMetricFamily, "write_backpressure_timeouts", "tier_write_backpressure_timeouts",
     "Stores whose wait for room in the tier write queue timed out."),
    (CounterMetricFamily, "promoted_blocks", "tier_promoted_blocks",
     "Blocks copied up from a tier into CPU slots for a load."),
)  # fmt: skip
"""The engine-wide tier counters and gauges: (family, name, ``EngineStats`` field, help)."""


def _buckets(hist: LatencyHistogram) -> list[tuple[str, float]]:
    bounds = [f"{b:g}" for b in hist.bounds] + ["+Inf"]
    return list(zip(bounds, accumulate(hist.counts), strict=True))


def tier_families(s: EngineStats) -> Iterator[Metric]:
    for attr, name, doc in _COUNTERS:
        family = CounterMetricFamily(P + name, doc, labels=["tier"])
        for t in s.tiers:
            family.add_metric([t.name], float(getattr(t, attr)))
        yield family
    held = GaugeMetricFamily(P + "bytes", "Bytes the tier holds (where it knows).", labels=["tier"])
    blocks = GaugeMetricFamily(
        P + "blocks", "Blocks the tier holds (where it knows).", labels=["tier"]
    )
    up = GaugeMetricFamily(P + "available", "1 unless the tier is backed off.", labels=["tier"])
    latency = HistogramMetricFamily(
        P + "op_duration_seconds", "Tier call latency by operation.", labels=["tier", "op"]
    )
    for t in s.tiers:
        if t.bytes is not None:
            held.add_metric([t.name], t.bytes)
        if t.blocks is not None:
            blocks.add_metric([t.name], t.blocks)
        up.add_metric([t.name], 1.0 if t.available else 0.0)
        for op, hist in t.op_seconds.items():
            latency.add_metric([t.name, op], buckets=_buckets(hist), sum_value=hist.sum)
    yield held
    yield blocks
    yield up
    yield latency
    for kind, name, attr, doc in _ENGINE_SCALARS:
        yield kind(P + name, doc, value=getattr(s, attr))
