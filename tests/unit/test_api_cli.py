"""``serve``: flags override environment, environment overrides the config file."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvcache_offload_service.cli import build_config, serve


def test_flags_beat_environment_which_beats_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_file = tmp_path / "offload.toml"
    config_file.write_text('port = 7001\neviction_policy = "arc"\nlease_ttl_s = 5.0\n')
    monkeypatch.setenv("KVCACHE_OFFLOAD_PORT", "7002")
    monkeypatch.setenv("KVCACHE_OFFLOAD_LEASE_TTL_S", "6.0")
    config = build_config(config_file, port=7003, eviction_policy=None)
    assert config.port == 7003  # flag
    assert config.lease_ttl_s == 6.0  # environment
    assert config.eviction_policy == "arc"  # file


def test_api_token_flag_becomes_a_secret() -> None:
    config = build_config(None, api_token="t0k")
    assert config.api_token is not None
    assert config.api_token.get_secret_value() == "t0k"
    assert "t0k" not in repr(config)


def test_bad_settings_exit_with_a_message_instead_of_a_traceback() -> None:
    app = typer.Typer()
    app.command()(serve)
    result = CliRunner().invoke(app, ["--cpu-bytes", "lots"])
    assert result.exit_code == 2
    assert "cpu_bytes_to_use" in result.output


def test_help_lists_the_main_flags() -> None:
    app = typer.Typer()
    app.command()(serve)
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for flag in ("--host", "--port", "--config", "--cpu-bytes", "--policy", "--api-token"):
        assert flag in result.output


def _serve(*args: str) -> object:
    app = typer.Typer()
    app.command()(serve)
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["--policy", "bogus"], "unknown cache policy 'bogus'"),
        (["--cpu-bytes", "1"], "holds no block: one offloaded block is 2.00 MiB"),
        # 20 TiB: within every policy's block limit (alru's is 2**25 blocks, 64 TiB here)
        (["--cpu-bytes", "20TiB"], "memory available: lower --cpu-bytes"),
    ],
    ids=["unknown-policy", "no-block", "beyond-host-memory"],
)
def test_impossible_configurations_exit_2_with_one_line_before_serving(
    args: list[str], reason: str
) -> None:
    result = _serve("--port", "1", *args)  # port 1 is never bound: the checks come first
    assert result.exit_code == 2  # type: ignore[attr-defined]
    output = result.output  # type: ignore[attr-defined]
    assert reason in output
    assert "Traceback" not in output and len(output.strip().splitlines()) == 1


def test_tier_check_counts_blocks_memory_and_shm() -> None:
    from kvcache_offload.dataplane.memory.tier_check import check_cpu_tier
    from kvcache_offload.errors import ConfigError

    check_cpu_tier(4, 1024, 4096, available=4096)
    with pytest.raises(ConfigError, match=r"only 4\.00 KiB of memory available"):
        check_cpu_tier(5, 1024, 5120, available=4096)


def test_serve_reports_a_settings_old_environment_name_once_and_honours_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVCACHE_OFFLOAD_GC_FREEZE", "0")
    config = build_config(None, port=9)
    assert config.transfer.gc_freeze is False and config.port == 9
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "KVCACHE_OFFLOAD_TRANSFER__GC_FREEZE" in lines[0]


def test_tier_write_backpressure_flags_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvcache_offload_service.cli as cli

    built: list[object] = []

    def capture(config_file: Path | None = None, **flags: object) -> object:
        built.append(build_config(config_file, **flags))
        raise typer.Exit(0)

    monkeypatch.setattr(cli, "build_config", capture)
    result = _serve("--tier-write-backpressure", "--tier-write-backpressure-timeout", "2.5")
    assert result.exit_code == 0, result.output  # type: ignore[attr-defined]
    (config,) = built
    assert config.tier_write_backpressure is True  # type: ignore[attr-defined]
    assert config.tier_write_backpressure_timeout_s == 2.5  # type: ignore[attr-defined]
    monkeypatch.setenv("KVCACHE_OFFLOAD_TIER_WRITE_BACKPRESSURE", "true")
    assert build_config(None).tier_write_backpressure is True
