"""Every query of the Grafana dashboard works against a real Prometheus scraping the real service.

The service runs as its own process (the ``kvcache-offload serve`` entry point) on 127.0.0.1 with a
tiny CPU tier; a real ``prometheus`` scrapes it every second with the scrape job of
``docker/prometheus.yml``. Traffic goes through the HTTP API: lookups, reuse-filtered stores,
sidecar stores and loads, remote block uploads and downloads that force evictions, a rejected
store, expired store and load leases, an SSE subscriber and a few 4xx answers. Then every PromQL
expression of ``dashboards/kvcache-offload.json`` (Grafana's macros and template variables
substituted) must parse and return at least one finite sample. A panel showing "No data" on a
busy service is a bug this test is here to catch.

Also: ``promtool check config`` on ``docker/prometheus.yml`` and ``promtool check metrics`` on the
service's ``/metrics`` text. Skipped only when the ``prometheus`` binary is not installed.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

from tests._ports import free_port
from tests._regions import region_name

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboards" / "kvcache-offload.json"
PROMETHEUS_CONFIG = ROOT / "docker" / "prometheus.yml"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus binary is not installed"),
]

BLOCK_BYTES = 1024
CAPACITY_BLOCKS = 16
STORE_THRESHOLD = 2
"""The reuse filter stores a block only on its second ``prepare_store`` offer."""
MACROS = {
    # Grafana computes $__rate_interval as max(4 x scrape interval, $__interval + scrape
    # interval); a minute covers the whole test, so every series has enough samples.
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "5m",
}
STARTUP_TIMEOUT_S = 30.0
DATA_TIMEOUT_S = 30.0

T = TypeVar("T")


def wait_for(
    what: str, check: Callable[[], T | None], timeout_s: float, interval_s: float = 0.1
) -> T:
    """Poll ``check`` until it returns a value other than None/False, or fail after the deadline."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while True:
        try:
            value = check()
            if value is not None and value is not False:
                return value
        except (httpx.HTTPError, OSError) as exc:
            last_error = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what} ({last_error})")
        time.sleep(interval_s)  # polling pause between condition checks, not synchronisation


@dataclass
class Proc:
    """A child process and the file its output goes to (shown when something goes wrong)."""

    popen: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@contextlib.contextmanager
def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[Proc]:
    """Run ``cmd`` for the duration of the block; always terminated (then killed) afterwards."""
    with log.open("wb") as out:
        popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    proc = Proc(popen, log)
    try:
        yield proc
    finally:
        popen.terminate()
        try:
            popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(timeout=10)


def serve_command(port: int) -> list[str]:
    """The installed ``kvcache-offload`` entry point (or the same function via this Python)."""
    args = ["serve", "--host", "127.0.0.1", "--port", str(port)]
    script = Path(sys.executable).parent / "kvcache-offload"
    if script.exists():
        return [str(script), *args]
    return [sys.executable, "-c", "from kvcache_offload.cli import main; main()", *args]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("service")
    port = free_port()
    env = {
        **os.environ,
        "KVCACHE_OFFLOAD_BACKEND": "cpu",
        "KVCACHE_OFFLOAD_LAYOUT__BYTES_PER_BLOCK": str(BLOCK_BYTES),
        "KVCACHE_OFFLOAD_CPU_BYTES_TO_USE": str(BLOCK_BYTES * CAPACITY_BLOCKS),
        "KVCACHE_OFFLOAD_STORE_THRESHOLD": str(STORE_THRESHOLD),
        "KVCACHE_OFFLOAD_MRC_SAMPLE_RATE": "1.0",
        "KVCACHE_OFFLOAD_LEASE_TTL_S": "30",
        # A disk tier, so the "Secondary tiers" panels have data too.
        "KVCACHE_OFFLOAD_DISK_PATH": str(tmp / "disk-tier"),
        "KVCACHE_OFFLOAD_DISK_BYTES": "64MiB",
        # Expired leases free their slots at once: the traffic below reuses them right away.
        "KVCACHE_OFFLOAD_LEASE_GRACE_S": "0",
        "KVCACHE_OFFLOAD_SHARED_REGION": "true",  # the sidecar flow needs one
        "KVCACHE_OFFLOAD_REGION_NAME": region_name("dashboard"),
    }
    with spawn(serve_command(port), tmp / "service.log", env) as proc:
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            assert proc.alive(), f"the service exited:\n{proc.output()}"
            return httpx.get(f"{url}/readyz", timeout=2).status_code == 200

        wait_for("the service to be ready", ready, STARTUP_TIMEOUT_S)
        yield url
        assert proc.alive(), f"the service died during the test:\n{proc.output()}"


def prometheus_config(target: str) -> dict[str, Any]:
    """docker/prometheus.yml, pointed at ``target`` and scraping every second."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    (job,) = config["scrape_configs"]
    job["scrape_interval"] = "1s"
    job["scrape_timeout"] = "1s"
    job["static_configs"] = [{"targets": [target]}]
    return config


@pytest.fixture(scope="module")
def prometheus(service: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    assert PROMETHEUS is not None
    tmp = tmp_path_factory.mktemp("prometheus")
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(service.removeprefix("http://"))))
    port = free_port()
    cmd = [
        PROMETHEUS,
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    with spawn(cmd, tmp / "prometheus.log") as proc:
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            assert proc.alive(), f"prometheus exited:\n{proc.output()}"
            return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200

        wait_for("prometheus to be ready", ready, STARTUP_TIMEOUT_S)
        yield url


class PromQL:
    """Instant queries through Prometheus' HTTP API."""

    def __init__(self, url: str) -> None:
        self.client = httpx.Client(base_url=url, timeout=10)

    def raw(self, expr: str) -> dict[str, Any]:
        """The API's JSON answer; a 400 (bad expression) is returned, not raised."""
        answer: dict[str, Any] = self.client.post("/api/v1/query", data={"query": expr}).json()
        return answer

    def vector(self, expr: str) -> list[dict[str, Any]]:
        answer = self.raw(expr)
        assert answer["status"] == "success", f"{expr}: {answer}"
        assert answer["data"]["resultType"] == "vector", expr
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    def value(self, expr: str) -> float | None:
        """The single sample of ``expr``, or None while it has none."""
        result = self.vector(expr)
        return float(result[0]["value"][1]) if result else None


def finite_samples(answer: dict[str, Any]) -> int:
    return sum(
        1 for series in answer["data"]["result"] if not math.isnan(float(series["value"][1]))
    )


def iter_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels", []))


def dashboard_queries(instance_regex: str) -> list[tuple[str, str]]:
    """``(panel title / refId, expr)`` with Grafana's macros and template variables replaced."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {
        f"${v['name']}": instance_regex
        for v in dashboard["templating"]["list"]
        if v["type"] == "query"
    }
    queries = []
    for panel in iter_panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in {**MACROS, **variables}.items():
                expr = expr.replace("${" + name[1:] + "}", value).replace(name, value)
            assert "$" not in expr, f"unsubstituted variable in {panel['title']}: {expr}"
            queries.append((f"{panel['title']} [{target['refId']}]", expr))
    return queries


def variable_queries() -> list[str]:
    """The dashboard's ``label_values(metric, label)`` variables as equivalent PromQL."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = []
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["definition"])
            assert match, var["definition"]
            metric, label = match.groups()
            exprs.append(f"group by ({label}) ({metric})")
    return exprs


def hex_key(i: int) -> str:
    """An offload key: 8-byte block hash + 4-byte group index 0."""
    return f"{i:016x}00000000"


def content_byte(key: str) -> int:
    """The byte an uploaded block of ``key`` is filled with (so a download can be checked)."""
    return int(key[:16], 16) % 251


class Traffic:
    """Drives the service through its HTTP API, checking each answer is the expected one."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client
        self.next_key = 1

    def fresh_keys(self, n: int) -> list[str]:
        keys = [hex_key(self.next_key + i) for i in range(n)]
        self.next_key += n
        return keys

    def post(self, path: str, body: dict[str, Any], expect: int = 200) -> dict[str, Any]:
        response = self.client.post(path, json=body)
        assert response.status_code == expect, f"{path}: {response.status_code} {response.text}"
        answer: dict[str, Any] = response.json()
        return answer

    def offer(self, keys: list[str]) -> None:
        """Offer the keys for storing until the reuse filter's next offer stores them.

        Each of these offers is skipped by the filter (counted as reuse-filter skips).
        """
        for _ in range(STORE_THRESHOLD - 1):
            lease = self.sidecar_store(keys)
            assert lease["keys_to_store"] == [], lease

    def sidecar_store(
        self, keys: list[str], *, complete: bool = True, ttl_s: float | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"keys": keys}
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        lease = self.post("/v1/store/prepare", body)
        if complete:
            self.post("/v1/store/complete", {"lease_id": lease["lease_id"], "success": True})
        return lease

    def upload(self, keys: list[str]) -> dict[str, Any]:
        """PUT the blocks; block ``k`` is filled with the byte ``content_byte(k)``."""
        body = b"".join(bytes([content_byte(k)]) * BLOCK_BYTES for k in keys)
        response = self.client.put("/v1/blocks", params={"keys": keys}, content=body)
        assert response.status_code == 200, response.text
        answer: dict[str, Any] = response.json()
        return answer

    def download(self, key: str, expect: int = 200) -> bytes:
        response = self.client.get(f"/v1/blocks/{key}")
        assert response.status_code == expect, response.text
        return response.content


def drive_sidecar_traffic(traffic: Traffic) -> None:
    """Lookups, reuse-filter skips, sidecar stores that evict, hits and loads."""
    # Lookups that miss, then a store the reuse filter refuses (keys offered only once).
    once = traffic.fresh_keys(4)
    assert traffic.post("/v1/lookup", {"keys": once})["hits"] == 0
    traffic.offer(once)

    # Sidecar stores (prepare + complete) of keys offered often enough, then hits and loads.
    stored = traffic.fresh_keys(4)
    traffic.offer(stored)
    lease = traffic.sidecar_store(stored)
    assert lease["keys_to_store"] == stored
    assert traffic.post("/v1/lookup", {"keys": stored})["hits"] == len(stored)
    load = traffic.post("/v1/load/prepare", {"keys": stored})
    traffic.post("/v1/load/complete", {"lease_id": load["lease_id"]})
    traffic.post("/v1/touch", {"keys": stored})

    # Sidecar stores of 2 x capacity blocks: the CPU tier has to evict.
    evicted: list[str] = []
    keys: list[str] = []
    for _ in range(2 * CAPACITY_BLOCKS // 8):
        keys = traffic.fresh_keys(8)
        traffic.offer(keys)
        evicted += traffic.sidecar_store(keys)["evicted_keys"]
    assert evicted, "storing 2 x capacity blocks evicted nothing"
    assert traffic.post("/v1/lookup", {"keys": keys})["hits"] == len(keys)


def drive_remote_traffic(traffic: Traffic) -> str | None:
    """PUT a capacity's worth of blocks (evicting again), GET one back and one evicted block.

    Returns what went wrong instead of raising, so the dashboard checks still run when remote
    mode is broken; ``test_remote_blocks_round_trip`` reports it.
    """
    try:
        uploaded: list[str] = []
        evicted: list[str] = []
        for _ in range(CAPACITY_BLOCKS // 8):
            keys = traffic.fresh_keys(8)
            traffic.offer(keys)
            answer = traffic.upload(keys)
            assert answer["keys_stored"] == keys, answer
            uploaded += keys
            evicted += answer["evicted_keys"]
        assert evicted, "uploading a capacity's worth of blocks evicted nothing"
        last = uploaded[-1]
        assert traffic.download(last) == bytes([content_byte(last)]) * BLOCK_BYTES
        # The CPU tier evicted it, the disk tier kept it: the download promotes it back (its
        # bytes are whatever the sidecar client left in the slot; byte-exactness across tiers
        # is tests/integration/test_tiers_*.py's job).
        wait_for(
            "the evicted block to reach the disk tier",
            lambda: traffic.post("/v1/lookup", {"keys": evicted[:1]})["tiers"] == ["disk"],
            10.0,
        )
        assert len(traffic.download(evicted[0])) == BLOCK_BYTES
        traffic.download(hex_key(10**9 + 1), expect=409)
    except AssertionError as exc:
        return str(exc)
    return None


def drive_failures(traffic: Traffic, stats: Callable[[], dict[str, Any]]) -> None:
    """4xx answers, a rejected store, and store and load leases that expire."""
    traffic.post("/v1/load/complete", {"lease_id": "no-such-lease"}, expect=404)
    traffic.post("/v1/load/prepare", {"keys": [hex_key(10**9)]}, expect=409)

    # A load lease that is never completed pins one block, and a store lease that is never
    # completed pins the rest: the next store is rejected; then both leases expire and roll back.
    ready = traffic.fresh_keys(1)
    traffic.offer(ready)
    assert traffic.sidecar_store(ready)["keys_to_store"] == ready
    traffic.post("/v1/load/prepare", {"keys": ready, "ttl_s": 1.0})
    pinned = traffic.fresh_keys(CAPACITY_BLOCKS - 1)
    traffic.offer(pinned)
    traffic.sidecar_store(pinned, complete=False, ttl_s=1.0)
    rejected = traffic.fresh_keys(1)
    traffic.offer(rejected)
    traffic.post("/v1/store/prepare", {"keys": rejected}, expect=507)

    def both_leases_expired() -> bool:
        expired = stats()["leases_expired"]
        return expired.get("store", 0) >= 1 and expired.get("load", 0) >= 1

    wait_for("the store and load leases to expire", both_leases_expired, 10.0)

    # After the roll-back the tier takes stores again (the filter already counted two offers).
    assert traffic.sidecar_store(rejected)["keys_to_store"] == rejected


def saw_event(lines: Iterator[str], event_type: str) -> bool:
    """Read an SSE stream until an event of ``event_type`` (False if the stream ends first)."""
    return any(line == f"event: {event_type}" for line in lines)


@dataclass
class Scraped:
    """Prometheus after it scraped the service through the whole traffic run."""

    promql: PromQL
    instance: str
    remote_error: str | None


@pytest.fixture(scope="module")
def scraped(service: str, prometheus: str) -> Scraped:
    promql = PromQL(prometheus)
    instance = service.removeprefix("http://")
    up = f'up{{instance="{instance}"}}'
    wait_for("the first successful scrape", lambda: promql.value(up) == 1.0, DATA_TIMEOUT_S)
    with httpx.Client(base_url=service, timeout=10) as client:
        traffic = Traffic(client)

        def stats() -> dict[str, Any]:
            answer: dict[str, Any] = client.get("/v1/stats").json()
            return answer

        # An SSE subscriber stays connected through the traffic and sees its events.
        with client.stream("GET", "/v1/events") as events:
            assert events.status_code == 200
            wait_for("the subscriber to register", lambda: stats()["event_subscribers"] >= 1, 10.0)
            drive_sidecar_traffic(traffic)
            remote_error = drive_remote_traffic(traffic)
            drive_failures(traffic, stats)
            seen_subscriber = (
                f'max_over_time(kvcache_offload_event_subscribers{{instance="{instance}"}}[1m])'
            )
            wait_for(
                "Prometheus to see the SSE subscriber",
                lambda: (promql.value(seen_subscriber) or 0) >= 1,
                DATA_TIMEOUT_S,
            )
            # The events were sent during the traffic; the client's read timeout bounds this.
            assert saw_event(events.iter_lines(), "stored")
        final = stats()
    # Every counter the traffic moved must have reached Prometheus before checking panels.
    lookups = f'kvcache_offload_lookups_total{{instance="{instance}"}}'
    wait_for(
        "Prometheus to scrape the final counters",
        lambda: promql.value(lookups) == final["lookups"],
        DATA_TIMEOUT_S,
    )
    return Scraped(promql, instance, remote_error)


@dataclass
class Evaluated:
    """Every dashboard query with Prometheus' answer, once the data is in."""

    queries: list[tuple[str, str]]
    answers: dict[str, dict[str, Any]]

    def without_data(self) -> list[tuple[str, str]]:
        return [(t, e) for t, e in self.queries if finite_samples(self.answers[e]) == 0]


@pytest.fixture(scope="module")
def evaluated(scraped: Scraped) -> Evaluated:
    """Evaluates every query, polling until each has a finite sample."""
    queries = dashboard_queries(scraped.instance) + dashboard_queries(".*")
    assert len(queries) >= 30
    result = Evaluated(queries, {})

    def settled() -> bool:
        for _, expr in queries:
            answer = result.answers.get(expr)
            if answer is None or finite_samples(answer) == 0:
                result.answers[expr] = scraped.promql.raw(expr)
        return all(finite_samples(result.answers[e]) for _, e in queries)

    with contextlib.suppress(AssertionError):  # the tests below say what is missing
        wait_for("every dashboard query to return data", settled, DATA_TIMEOUT_S, 0.5)
    return result


def test_every_dashboard_query_is_valid_promql(evaluated: Evaluated) -> None:
    invalid = [
        f"{title}: {expr}\n  -> {answer.get('errorType')}: {answer.get('error')}"
        for title, expr in evaluated.queries
        if (answer := evaluated.answers[expr])["status"] != "success"
    ]
    assert not invalid, "invalid PromQL in the dashboard:\n" + "\n".join(invalid)


def test_every_dashboard_query_returns_data(evaluated: Evaluated) -> None:
    """Every panel shows a finite value, transfer panels included (remote block traffic)."""
    missing = [f"{t}: {e}" for t, e in evaluated.without_data()]
    assert not missing, "dashboard queries with no finite sample:\n" + "\n".join(missing)


def test_dashboard_variables_list_the_service_instance(scraped: Scraped) -> None:
    for expr in variable_queries():
        values = {series["metric"].get("instance") for series in scraped.promql.vector(expr)}
        assert scraped.instance in values, expr


def test_remote_blocks_round_trip(scraped: Scraped) -> None:
    """PUT /v1/blocks stored and evicted, GET /v1/blocks/{key} returned the uploaded bytes."""
    assert scraped.remote_error is None, scraped.remote_error


def test_counters_in_prometheus_match_the_traffic(scraped: Scraped) -> None:
    def total(selector: str) -> float:
        metric, _, matchers = selector.partition("{")
        labels = f'instance="{scraped.instance}"' + ("," + matchers.rstrip("}") if matchers else "")
        value = scraped.promql.value(f"sum({metric}{{{labels}}})")
        assert value is not None, selector
        return value

    assert total("kvcache_offload_evicted_blocks_total") > 0
    assert total("kvcache_offload_stores_rejected_total") >= 1
    assert total("kvcache_offload_reuse_filter_skipped_blocks_total") >= 4
    assert total('kvcache_offload_leases_expired_total{kind="store"}') >= 1
    assert total('kvcache_offload_leases_expired_total{kind="load"}') >= 1
    assert total("kvcache_offload_lookup_hit_blocks_total") > 0
    assert total("kvcache_offload_load_blocks_completed_total") > 0
    assert total('kvcache_offload_http_requests_total{status=~"4.."}') >= 3
    assert total('kvcache_offload_http_requests_total{status="507"}') >= 1
    assert total('kvcache_offload_events_published_total{type="evicted"}') > 0
    assert total("kvcache_offload_capacity_blocks") == CAPACITY_BLOCKS
    assert total("kvcache_offload_mrc_sampled_keys") > 0
    mrc = scraped.promql.vector(f'kvcache_offload_mrc_hit_ratio{{instance="{scraped.instance}"}}')
    # The "gained by 2x" panel selects scale="1" and scale="2": the label values must match.
    assert {s["metric"]["scale"] for s in mrc} == {"0.25", "0.5", "1", "2", "4", "8"}


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed")
def test_promtool_accepts_the_compose_prometheus_config() -> None:
    assert PROMTOOL is not None
    result = subprocess.run(
        [PROMTOOL, "check", "config", "--syntax-only", str(PROMETHEUS_CONFIG)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed")
def test_promtool_accepts_the_test_prometheus_config(tmp_path: Path) -> None:
    assert PROMTOOL is not None
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config("127.0.0.1:1")))
    result = subprocess.run(
        [PROMTOOL, "check", "config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed")
def test_promtool_lints_the_metrics_exposition_clean(scraped: Scraped, service: str) -> None:
    assert PROMTOOL is not None
    text = httpx.get(f"{service}/metrics", timeout=10).text
    assert "kvcache_offload_transfer_duration_seconds_bucket" in text
    result = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
