"""The Grafana dashboard may only use what ``docs/metrics.md`` (the metric contract) promises.

A panel over a metric or label the service does not export shows "No data" forever, which nobody
notices until an incident; this catches it at review time. The Prometheus integration test
(``tests/integration/test_prometheus_dashboard.py``) then checks every query against live data.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboards" / "kvcache-offload.json"
CONTRACT = ROOT / "docs" / "metrics.md"
TARGET_LABELS = {"instance", "job"}
"""Labels Prometheus attaches to every scraped series."""
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
METRIC = re.compile(r"\bkvcache_offload_[a-z0-9_]+\b")
SELECTOR = re.compile(r"\b(kvcache_offload_[a-z0-9_]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
LEGEND_LABEL = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")


def load_contract() -> dict[str, tuple[str, set[str]]]:
    """``name -> (type, labels)`` from the table in docs/metrics.md."""
    contract: dict[str, tuple[str, set[str]]] = {}
    for line in CONTRACT.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`kvcache_offload_"):
            continue
        name = cells[0].strip("`")
        contract[name] = (cells[1], set(re.findall(r"`([a-z_]+)`", cells[2])))
    return contract


def iter_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels", []))


def dashboard_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """``(panel title, expr, legendFormat)`` of every Prometheus target."""
    for panel in iter_panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"], target.get("legendFormat", "")


def base_metric(name: str, contract: dict[str, tuple[str, set[str]]]) -> str | None:
    """The contract name a series name belongs to (histogram series have suffixes)."""
    if name in contract:
        return name
    for suffix in HISTOGRAM_SUFFIXES:
        base = name.removesuffix(suffix)
        if base != name and contract.get(base, ("",))[0] == "histogram":
            return base
    return None


@pytest.fixture(scope="module")
def contract() -> dict[str, tuple[str, set[str]]]:
    table = load_contract()
    assert len(table) > 10, "could not parse the metric table in docs/metrics.md"
    return table


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def allowed_labels(expr: str, contract: dict[str, tuple[str, set[str]]]) -> set[str]:
    labels = set(TARGET_LABELS)
    for name in METRIC.findall(expr):
        base = base_metric(name, contract)
        if base is not None:
            labels |= contract[base][1]
            if name.endswith("_bucket"):
                labels.add("le")
    return labels


def test_dashboard_uses_only_contract_metric_names(
    dashboard: dict[str, Any], contract: dict[str, tuple[str, set[str]]]
) -> None:
    unknown = {
        (title, name)
        for title, expr, _ in dashboard_queries(dashboard)
        for name in METRIC.findall(expr)
        if base_metric(name, contract) is None
    }
    assert unknown == set()


def test_dashboard_selectors_use_only_labels_of_their_metric(
    dashboard: dict[str, Any], contract: dict[str, tuple[str, set[str]]]
) -> None:
    bad = []
    for title, expr, _ in dashboard_queries(dashboard):
        for name, matchers in SELECTOR.findall(expr):
            base = base_metric(name, contract)
            assert base is not None, (title, name)
            allowed = (
                contract[base][1] | TARGET_LABELS | ({"le"} if name.endswith("_bucket") else set())
            )
            bad += [
                (title, name, label) for label in MATCHER.findall(matchers) if label not in allowed
            ]
    assert bad == []


def test_dashboard_groupings_and_legends_use_exported_labels(
    dashboard: dict[str, Any], contract: dict[str, tuple[str, set[str]]]
) -> None:
    bad = []
    for title, expr, legend in dashboard_queries(dashboard):
        allowed = allowed_labels(expr, contract)
        used = {lab.strip() for group in GROUPING.findall(expr) for lab in group.split(",")}
        used |= set(LEGEND_LABEL.findall(legend))
        bad += [(title, label) for label in used - {""} if label not in allowed]
    assert bad == []


def test_every_contract_metric_has_a_panel(
    dashboard: dict[str, Any], contract: dict[str, tuple[str, set[str]]]
) -> None:
    used = {
        base_metric(name, contract)
        for _, expr, _ in dashboard_queries(dashboard)
        for name in METRIC.findall(expr)
    }
    assert set(contract) - used == set()


def test_template_variable_queries_use_contract_metrics(
    dashboard: dict[str, Any], contract: dict[str, tuple[str, set[str]]]
) -> None:
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["definition"])
        assert match, var["definition"]
        name, label = match.groups()
        assert name in contract
        assert label in contract[name][1] | TARGET_LABELS


def test_every_panel_queries_prometheus_through_the_datasource_variable(
    dashboard: dict[str, Any],
) -> None:
    ids = []
    for panel in iter_panels(dashboard["panels"]):
        ids.append(panel["id"])
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel.get("description"), f"{panel['title']} should say what it answers"
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert dashboard["uid"] == "kvcache-offload"
    assert 36 <= dashboard["schemaVersion"] <= 41


def test_transfer_latency_heatmap_reads_histogram_buckets(dashboard: dict[str, Any]) -> None:
    heatmaps = [p for p in iter_panels(dashboard["panels"]) if p["type"] == "heatmap"]
    assert heatmaps
    for panel in heatmaps:
        (target,) = panel["targets"]
        assert "kvcache_offload_transfer_duration_seconds_bucket" in target["expr"]
        assert "by (le)" in target["expr"]
        assert target["format"] == "heatmap"
