"""The base install's command line: every command that needs no extra works, and one that
does names the extra in one line, before doing any work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SERVER = ("fastapi", "uvicorn", "sse_starlette", "prometheus_client", "httpx", "orjson", "click")
"""What the server extra installs (click comes with uvicorn; typer carries its own)."""


def run_cli(
    *args: str, without: tuple[str, ...] = (), cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    """``python -m kvcache_offload ARGS`` as if the modules in ``without`` were not installed."""
    block = "".join(f"sys.modules[{m!r}] = None\n" for m in without)
    code = f"import sys\n{block}sys.argv = ['kvcache-offload', *{list(args)!r}]\n"
    code += "from kvcache_offload.cli import main\nmain()\n"
    env = {**os.environ, "COLUMNS": "80"}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env
    )


def test_help_and_version_need_no_extra() -> None:
    result = run_cli("--help", without=(*SERVER, "matplotlib"))
    assert result.returncode == 0, result.stderr
    assert "serve" in result.stdout and "replay" in result.stdout
    assert run_cli("--version", without=SERVER).returncode == 0


def test_serve_without_the_server_extra_names_it_in_one_line() -> None:
    result = run_cli("serve", without=SERVER)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "pip install 'kvcache-offload[server]'" in lines[0]


def test_serve_help_needs_no_extra_and_keeps_whole_option_names() -> None:
    result = run_cli("serve", "--help", without=SERVER)
    assert result.returncode == 0, result.stderr
    assert "--kv-events-replay-endpoint" in result.stdout
    assert "--shared-region / --no-shared-region" in result.stdout
    assert "<bool>" not in result.stdout and "…" not in result.stdout


def test_replay_runs_on_the_base_install(tmp_path: Path) -> None:
    result = run_cli("replay", "--capacity", "10", "--policy", "lru", without=SERVER)
    assert result.returncode == 0, result.stderr
    assert "lru" in result.stdout


def test_replay_plot_without_matplotlib_fails_in_one_line_before_replaying(
    tmp_path: Path,
) -> None:
    out = tmp_path / "json.out"
    result = run_cli(
        "replay", "--plot", str(tmp_path / "p.png"), "--json", str(out), without=("matplotlib",)
    )
    assert result.returncode != 0
    text = (result.stdout + result.stderr).strip()
    assert "Traceback" not in text
    assert len(text.splitlines()) == 1, text
    assert "pip install 'kvcache-offload[plot]'" in text
    assert not out.exists() and not (tmp_path / "p.png").exists()


def test_a_command_whose_module_cannot_import_says_why_in_one_line() -> None:
    # Without the service package at all (e.g. a broken install), `serve` still fails in
    # one line rather than breaking the whole command line.
    result = run_cli("serve", without=("kvcache_offload_service", "kvcache_offload_service.cli"))
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert run_cli("--help", without=("kvcache_offload_service",)).returncode == 0
