"""Control: vLLM's own OffloadingConnector unit tests pass in this environment.

They come from vLLM's source tarball (scripts/vllm-tests.sh unpacks them into
.venv-vllm/<version>/src) and run unchanged, in their own pytest process (their package is
also called ``tests``). If they failed here, a failure of ours would say nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]


def test_vllms_offloading_connector_unit_tests_pass() -> None:
    src = Path(os.environ.get("VLLM_SRC", ROOT / ".venv-vllm" / version("vllm") / "src"))
    tests = src / "tests" / "v1" / "kv_connector" / "unit" / "offloading_connector"
    assert tests.is_dir(), f"vLLM's unit tests are missing under {src}: run scripts/vllm-tests.sh"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)],
        cwd=src,
        env={**os.environ, "PYTHONPATH": str(src)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    print(result.stdout.splitlines()[-1])
