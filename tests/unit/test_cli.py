"""The command line: version, help, and ``python -m kvcache_offload``."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from kvcache_offload import __version__
from kvcache_offload.cli import app


def test_version_flag_prints_the_package_version() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"kvcache-offload {__version__}"


def test_python_dash_m_lists_the_serve_and_replay_commands() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvcache_offload", "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "serve" in result.stdout and "replay" in result.stdout
