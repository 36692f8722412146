"""What a new user meets on a real server: the startup line, bounded headers, offline /docs."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from tests.integration._server import Server, running_server


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running_server("--log-level", "info") as srv:
        yield srv


def test_a_sixteen_megabyte_header_is_answered_431(server: Server) -> None:
    response = httpx.get(
        f"{server.url}/healthz", headers={"x-big": "a" * (16 * 1024**2)}, timeout=30
    )
    assert response.status_code == 431
    assert response.json()["error"] == "RequestHeaderFieldsTooLarge"


def test_ordinary_headers_and_a_large_body_still_pass(server: Server) -> None:
    assert httpx.get(f"{server.url}/healthz", headers={"x-a": "a" * 8192}).status_code == 200
    # a body sent together with its head is not counted as head
    response = httpx.post(
        f"{server.url}/v1/lookup", params={"keys": "00"}, content=b"x" * (1024 * 1024)
    )
    assert response.status_code != 431


def test_docs_load_no_asset_from_another_host(server: Server) -> None:
    page = httpx.get(f"{server.url}/docs").text
    assert "swagger-ui" in page
    assets = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert assets and all(a.startswith("/") for a in assets), assets
    for asset in assets:
        assert httpx.get(f"{server.url}{asset}").status_code == 200, asset


def test_the_startup_log_says_what_it_serves() -> None:
    with running_server("--log-level", "info", "--policy", "lru") as srv:
        pass
    out = srv.process.stdout.read().decode() if srv.process.stdout else ""
    line = next((x for x in out.splitlines() if "kvcache-offload" in x and "serving" in x), "")
    for part in ("policy lru", "tiers CPU", "capacity 32 blocks of 4 KiB", "backend"):
        assert part in line, out
