"""/metrics follows the contract in docs/metrics.md and moves with the traffic."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.unit._api_app import hex_key, served, store

CONTRACT = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def _contract() -> dict[str, str]:
    rows = re.findall(r"^\| `(kvcache_offload_\w+)` \| (\w+) \|", CONTRACT.read_text(), re.M)
    return dict(rows)


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def _families(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text)}


async def test_every_contract_metric_is_exported_with_its_type() -> None:
    async with served() as s:
        await s.client.post("/v1/lookup", json={"keys": [hex_key(1)]})
        text = (await s.client.get("/metrics")).text
    families = _families(text)
    for name, kind in _contract().items():
        family = name.removesuffix("_total") if kind == "counter" else name
        assert family in families, name
        assert families[family] == kind, (name, families[family])


async def test_counters_move_with_lookups_stores_and_requests() -> None:
    async with served() as s:
        before = _samples((await s.client.get("/metrics")).text)
        await store(s.client, [hex_key(1), hex_key(2)])
        await s.client.post("/v1/lookup", json={"keys": [hex_key(1), hex_key(2), hex_key(3)]})
        await s.client.post("/v1/lookup", json={"keys": ["bad"]})
        after = _samples((await s.client.get("/metrics")).text)

    def delta(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("kvcache_offload_lookups_total") == 1
    assert delta("kvcache_offload_lookup_keys_total") == 3
    assert delta("kvcache_offload_lookup_hit_blocks_total") == 2
    assert delta("kvcache_offload_store_blocks_completed_total") == 2
    assert delta("kvcache_offload_blocks", state="idle") == 2
    route = {"route": "/v1/lookup", "method": "POST"}
    assert delta("kvcache_offload_http_requests_total", status="200", **route) == 1
    assert delta("kvcache_offload_http_requests_total", status="422", **route) == 1
    assert delta("kvcache_offload_http_request_duration_seconds_count", **route) == 2


async def test_http_metrics_use_route_templates_not_raw_paths() -> None:
    async with served() as s:
        await s.client.get(f"/v1/blocks/{hex_key(7)}")
        await s.client.get("/no/such/path")
        text = (await s.client.get("/metrics")).text
    assert 'route="/v1/blocks/{key}"' in text
    assert hex_key(7) not in text
    assert 'route="unmatched"' in text


async def test_two_apps_in_one_process_keep_separate_registries() -> None:
    async with served() as a, served() as b:
        await a.client.post("/v1/lookup", json={"keys": [hex_key(1)]})
        text_b = (await b.client.get("/metrics")).text
    assert _samples(text_b)[("kvcache_offload_lookups_total", frozenset())] == 0
