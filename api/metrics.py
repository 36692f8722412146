"""Prometheus metrics: engine stats read at scrape time plus HTTP request counters.

Names and labels follow ``docs/metrics.md`` (the contract dashboards are built from). Each app
has its own :class:`CollectorRegistry`, so several apps in one process (tests) never collide.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvcache_offload import __version__, compiled_modules
from kvcache_offload.aio.types import EngineStats, EventType
from kvcache_offload.kv_events.stats import KVEventStats

from .tier_metrics import tier_families

__all__ = [
    "HTTP_DURATION_BUCKETS_S",
    "EngineCollector",
    "HttpMetrics",
    "HttpMetricsMiddleware",
    "build_registry",
]

P = "kvcache_offload_"
DIRECTIONS = ("gpu_to_cpu", "cpu_to_gpu")
LEASE_KINDS = ("store", "load")
BLOCK_STATES = ("free", "writing", "idle", "reading")
HTTP_DURATION_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
UNMATCHED_ROUTE = "unmatched"

_Scalar = tuple[type[CounterMetricFamily | GaugeMetricFamily], str, str, str]
_ENGINE_SCALARS: tuple[_Scalar, ...] = (
    (CounterMetricFamily, "lookups", "lookups",
     "Lookup calls."),
    (CounterMetricFamily, "lookup_keys", "lookup_keys",
     "Keys asked in lookups."),
    (CounterMetricFamily, "lookup_hit_blocks", "lookup_hit_blocks",
     "Keys in the ready prefix returned by lookups."),
    (CounterMetricFamily, "store_blocks_prepared", "store_blocks_prepared",
     "Blocks allocated by prepare_store."),
    (CounterMetricFamily, "store_blocks_completed", "store_blocks_completed",
     "Blocks that became loadable."),
    (CounterMetricFamily, "store_blocks_failed", "store_blocks_failed",
     "Blocks whose store failed (incl. expired leases)."),
    (CounterMetricFamily, "stores_rejected", "stores_rejected",
     "prepare_store calls refused (no evictable space)."),
    (CounterMetricFamily, "load_blocks_completed", "load_blocks_completed",
     "Blocks whose load completed."),
    (CounterMetricFamily, "evicted_ahead_blocks", "evicted_ahead_blocks",
     "Evictions that took a block chosen ahead of the store (behind a lone copy)."),
    (CounterMetricFamily, "released_evictions", "released_evictions",
     "Evictions that took a released block (a session's end) before the policy chose."),
    (CounterMetricFamily, "discarded_blocks", "discarded_blocks",
     "Blocks freed on a caller's word that nobody needs them again (session ends)."),
    (CounterMetricFamily, "reuse_filter_skipped_blocks", "reuse_filter_skipped_blocks",
     "Blocks not stored by the reuse filter."),
    (GaugeMetricFamily, "capacity_blocks", "capacity_blocks",
     "CPU tier capacity."),
    (GaugeMetricFamily, "released_blocks", "blocks_released",
     "Blocks released (a session's end) and still held: evicted first when room is needed."),
    (GaugeMetricFamily, "leases_active", "leases_active",
     "Prepared, not yet completed sidecar leases."),
    (GaugeMetricFamily, "event_subscribers", "event_subscribers",
     "Live event subscribers (SSE and in-process)."),
    (CounterMetricFamily, "events_dropped", "events_dropped",
     "Events subscribers missed by falling behind."),
    (GaugeMetricFamily, "mrc_sampled_keys", "mrc_sampled_keys",
     "Distinct keys tracked by the miss-ratio-curve sampler."),
    (CounterMetricFamily, "observer_dropped_requests", "observer_dropped_requests",
     "Requests left out of the miss-ratio curve and shadow estimates (their CPU budget)."),
)  # fmt: skip
"""The engine's unlabelled counters and gauges: (family, name, ``EngineStats`` field, help)."""


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(P + name, doc, value=value)


def _labelled_counter(
    name: str, doc: str, label: str, values: dict[str, Any], always: tuple[str, ...] = ()
) -> CounterMetricFamily:
    family = CounterMetricFamily(P + name, doc, labels=[label])
    for key in dict.fromkeys((*always, *values)):
        family.add_metric([key], float(values.get(key, 0)))
    return family


def _shadow_families(s: EngineStats) -> Iterator[Metric]:
    """Per candidate policy: hits on the shadow sample, and the hit ratio they make."""
    hits = CounterMetricFamily(
        P + "shadow_hit_blocks",
        "Sampled blocks each candidate policy would have hit (shadow simulation).",
        labels=["policy", "live"],
    )
    ratio = GaugeMetricFamily(
        P + "shadow_hit_ratio",
        "Block hit ratio each candidate policy would have had on the key sample.",
        labels=["policy", "live"],
    )
    n = s.shadow_sampled_blocks
    for policy, value in sorted(s.shadow_hit_blocks.items()):
        live = "true" if policy == s.shadow_live_policy else "false"
        hits.add_metric([policy, live], float(value))
        ratio.add_metric([policy, live], value / n if n else 0.0)
    yield hits
    yield ratio
    yield _counter("shadow_lookup_blocks", "Sampled blocks looked up by the shadow simulation.", n)


class EngineCollector(Collector):
    """Turns one ``engine.stats()`` snapshot per scrape into the contract's metric families."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats
        self._manager_build = "compiled" if all(compiled_modules().values()) else "python"

    def describe(self) -> list[Metric]:
        return []  # collected lazily: the engine may not exist when the registry is built

    def collect(self) -> Iterator[Metric]:
        build = GaugeMetricFamily(
            P + "build_info",
            "Always 1: the package version and how its manager runs (compiled or python).",
            labels=["version", "manager"],
        )
        build.add_metric([__version__, self._manager_build], 1)
        yield build
        s = self._stats()
        if s is None:
            return
        for kind, name, attr, doc in _ENGINE_SCALARS:
            yield kind(P + name, doc, value=getattr(s, attr))
        yield _labelled_counter(
            "evicted_blocks", "Blocks evicted.", "policy", {s.policy: s.evicted_blocks}
        )
        blocks = GaugeMetricFamily(
            P + "blocks", "CPU tier occupancy by block state.", labels=["state"]
        )
        for state, value in zip(
            BLOCK_STATES,
            (s.blocks_free, s.blocks_writing, s.blocks_idle, s.blocks_reading),
            strict=True,
        ):
            blocks.add_metric([state], value)
        yield blocks
        yield _labelled_counter(
            "transfer_bytes", "Bytes moved.", "direction", s.transfer_bytes, DIRECTIONS
        )
        yield _labelled_counter(
            "transfer_seconds",
            "Seconds spent in transfers.",
            "direction",
            s.transfer_seconds,
            DIRECTIONS,
        )
        duration = HistogramMetricFamily(
            P + "transfer_duration_seconds", "Per-job transfer time.", labels=["direction"]
        )
        for direction, hist in s.transfer_duration.items():
            duration.add_metric([direction], buckets=hist.cumulative(), sum_value=hist.sum)
        yield duration
        yield _labelled_counter(
            "leases_expired",
            "Leases rolled back after their TTL.",
            "kind",
            s.leases_expired,
            LEASE_KINDS,
        )
        yield _labelled_counter(
            "events_published",
            "Events published by the hub.",
            "type",
            s.events_published,
            tuple(t.value for t in EventType),
        )
        kv = s.kv_events if s.kv_events is not None else KVEventStats()
        yield _counter(
            "kv_events_batches_published",
            "KV-event batches sent on the ZMQ PUB socket (0 when it is off).",
            kv.batches_published,
        )
        yield _counter(
            "kv_events_published",
            "BlockStored / BlockRemoved / AllBlocksCleared events in published batches.",
            kv.events_published,
        )
        yield _counter("kv_events_replay_requests", "Replay requests answered.", kv.replay_requests)
        yield _counter(
            "kv_events_batches_replayed", "KV-event batches re-sent on replay.", kv.batches_replayed
        )
        yield _counter(
            "kv_events_lost",
            "Engine events the KV-event publisher could not read in time.",
            kv.events_lost,
        )
        mrc = GaugeMetricFamily(
            P + "mrc_hit_ratio",
            "Estimated block hit ratio at scale x the CPU tier capacity (SHARDS sample).",
            labels=["scale"],
        )
        for scale, ratio in sorted(s.mrc_hit_ratio.items()):
            mrc.add_metric([f"{scale:g}"], ratio)
        yield mrc
        yield from tier_families(s)
        yield from _shadow_families(s)


class HttpMetrics:
    """HTTP request counter and latency histogram, with label children cached."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            P + "http_requests",
            "HTTP requests.",
            ["route", "method", "status"],
            registry=registry,
        )
        self.duration = Histogram(
            P + "http_request_duration_seconds",
            "HTTP latency.",
            ["route", "method"],
            buckets=HTTP_DURATION_BUCKETS_S,
            registry=registry,
        )
        self._counters: dict[tuple[str, str, int], Any] = {}
        self._histograms: dict[tuple[str, str], Any] = {}

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        counter = self._counters.get((route, method, status))
        if counter is None:
            counter = self.requests.labels(route, method, str(status))
            self._counters[(route, method, status)] = counter
        counter.inc()
        hist = self._histograms.get((route, method))
        if hist is None:
            hist = self.duration.labels(route, method)
            self._histograms[(route, method)] = hist
        hist.observe(seconds)


class HttpMetricsMiddleware:
    """Counts every HTTP request by route template (never the raw path), method and status."""

    def __init__(self, app: ASGIApp, metrics: HttpMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or UNMATCHED_ROUTE
            self.metrics.observe(template, scope["method"], status, time.perf_counter() - start)


def build_registry(
    stats: Callable[[], EngineStats | None],
) -> tuple[CollectorRegistry, HttpMetrics]:
    """A fresh registry holding the engine collector and the HTTP metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(stats))
    return registry, HttpMetrics(registry)
