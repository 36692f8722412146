"""docs/http-api.md's curl tour covers every route and runs as written against a server."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvcache_offload_service import create_app
from tests.integration._server import running_server

DOC = Path(__file__).resolve().parents[2] / "docs" / "http-api.md"


def _tour() -> str:
    match = re.search(
        r"<!-- curl-tour:start -->\s*```bash\n(.*?)```\s*<!-- curl-tour:end -->",
        DOC.read_text(),
        re.S,
    )
    assert match, "docs/http-api.md lost its curl tour"
    return match.group(1)


def test_every_route_has_a_curl_example() -> None:
    tour = _tour()
    paths = create_app().openapi()["paths"]
    for path in paths:
        pattern = re.escape(path).replace(r"\{key\}", r"\$K2?")
        assert re.search(r"\$S" + pattern + r"\b", tour), f"no curl example for {path}"


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_the_curl_tour_runs_as_written(tmp_path: Path) -> None:
    with running_server() as server:
        script = _tour().replace("S=http://127.0.0.1:8000", f"S={server.url}")
        result = subprocess.run(
            ["bash", "-c", "set -euo pipefail\n" + script],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 0, result.stdout + result.stderr
    assert '"keys_stored":["0123456789abcdef00000000"]' in result.stdout
    assert '"reset":true' in result.stdout
