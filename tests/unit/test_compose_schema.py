"""The docker stack's files are checked statically: no docker engine is needed (or available).

``docker/compose.yaml`` must validate against the vendored Compose Specification schema, and the
files it wires together (Dockerfile, Prometheus config, Grafana provisioning, dashboard) must agree
with each other, so a typo is caught here rather than on someone's first ``docker compose up``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DASHBOARDS = ROOT / "dashboards"
SERVICE = "kvcache-offload"


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _yaml(DOCKER / "compose.yaml")


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    schema = json.loads((DOCKER / "compose-spec.schema.json").read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def test_compose_file_validates_against_the_compose_spec_schema(
    compose: dict[str, Any], validator: jsonschema.protocols.Validator
) -> None:
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(compose)
    ]
    assert errors == []


def test_schema_rejects_a_misspelt_service_key(
    compose: dict[str, Any], validator: jsonschema.protocols.Validator
) -> None:
    """Guards the test above against a schema that accepts anything."""
    broken = copy.deepcopy(compose)
    broken["services"][SERVICE]["helthcheck"] = broken["services"][SERVICE].pop("healthcheck")
    assert not validator.is_valid(broken)


def test_vendored_schema_matches_the_digest_in_its_readme() -> None:
    digest = hashlib.sha256((DOCKER / "compose-spec.schema.json").read_bytes()).hexdigest()
    readme = (DOCKER / "README-schema.md").read_text()
    assert digest in readme
    assert "Apache License" in readme


def test_compose_builds_the_service_from_the_repository_dockerfile(
    compose: dict[str, Any],
) -> None:
    build = compose["services"][SERVICE]["build"]
    context = (DOCKER / build["context"]).resolve()
    assert context == ROOT
    assert (context / build["dockerfile"]).is_file()


def test_compose_bind_mounts_exist(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith((".", "/")):
                assert (DOCKER / source).exists(), f"{name} mounts missing {source}"


def test_prometheus_scrapes_the_compose_service_on_its_container_port(
    compose: dict[str, Any],
) -> None:
    prom = _yaml(DOCKER / "prometheus.yml")
    targets = [
        t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    ]
    container_ports = {p.split(":")[-1] for p in compose["services"][SERVICE]["ports"]}
    assert targets
    for target in targets:
        host, port = target.rsplit(":", 1)
        assert host == SERVICE
        assert port in container_ports
    assert SERVICE in compose["services"]["prometheus"]["depends_on"]


def test_grafana_datasource_matches_dashboard_default_and_scrape_interval() -> None:
    sources = _yaml(DASHBOARDS / "provisioning" / "datasources" / "prometheus.yaml")["datasources"]
    prom = _yaml(DOCKER / "prometheus.yml")
    (source,) = sources
    dashboard = json.loads((DASHBOARDS / "kvcache-offload.json").read_text())
    ds_var = next(v for v in dashboard["templating"]["list"] if v["name"] == "DS_PROMETHEUS")
    assert ds_var["current"]["value"] == source["uid"]
    assert source["url"].startswith("http://prometheus:")
    assert source["jsonData"]["timeInterval"] == prom["global"]["scrape_interval"]


def test_grafana_loads_the_dashboard_from_where_compose_mounts_it(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"] if v.startswith("."))
    provider = _yaml(DASHBOARDS / "provisioning" / "dashboards" / "kvcache-offload.yaml")
    (entry,) = provider["providers"]
    path = entry["options"]["path"]
    host_dir = next(src for src, dst in mounts.items() if dst == path)
    assert (DOCKER / host_dir / "kvcache-offload.json").is_file()
    assert mounts["../dashboards/provisioning"] == "/etc/grafana/provisioning"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{path}/kvcache-offload.json"


def test_dockerfile_runs_as_non_root_with_cpu_torch_and_a_healthcheck() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^USER (?!root)\S+", text, re.M)
    assert "download.pytorch.org/whl/cpu" in text
    assert re.search(r"^ARG TORCH_VERSION=2\.13\.0$", text, re.M)
    assert re.search(r"^HEALTHCHECK .*", text, re.M) and "/healthz" in text
    assert '"serve", "--host", "0.0.0.0"' in text


def test_dockerignore_keeps_the_files_the_dockerfile_copies() -> None:
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = re.findall(r"^COPY (?!--from)(.+?) \S+$", (DOCKER / "Dockerfile").read_text(), re.M)
    for sources in copied:
        for src in sources.split():
            assert src in allowed, f"{src} is copied but excluded by .dockerignore"
            assert (ROOT / src).exists()


def test_image_and_compose_commands_use_existing_serve_flags(compose: dict[str, Any]) -> None:
    """The Dockerfile's CMD and compose's command must parse with the real ``serve`` CLI."""
    from typer.testing import CliRunner

    from kvcache_offload.cli import app

    cmd = re.search(r"^CMD (\[.*\])$", (DOCKER / "Dockerfile").read_text(), re.M)
    assert cmd
    for argv in (json.loads(cmd.group(1)), compose["services"][SERVICE]["command"]):
        assert argv[0] == "serve"
        # --help after the flags: typer parses (and rejects unknown) flags, then prints help.
        result = CliRunner().invoke(app, [*argv, "--help"])
        assert result.exit_code == 0, result.output
