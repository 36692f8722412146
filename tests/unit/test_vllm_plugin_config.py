"""The vLLM plug-in's version gate and config translation (no vLLM needed)."""

from __future__ import annotations

import logging

import pytest

from kvcache_offload.config import KVCacheLayout
from kvcache_offload.errors import ConfigError
from kvcache_offload.integrations.vllm._settings import offload_config
from kvcache_offload.integrations.vllm._versions import api_generation

LAYOUT = KVCacheLayout(gpu_block_sizes=[16], bytes_per_block=4096, world_size=2)


@pytest.mark.parametrize(
    ("release", "generation"),
    [("0.21.0", "handlers"), ("0.21.3+cu130", "handlers"), ("0.33.0", "worker")],
)
def test_supported_vllm_releases_pick_their_spec_api(release: str, generation: str) -> None:
    assert api_generation(release) == generation


@pytest.mark.parametrize("release", ["0.20.2", "0.22.0", "0.32.0", "1.0.0"])
def test_other_vllm_releases_are_refused_naming_the_supported_ones(release: str) -> None:
    with pytest.raises(ConfigError, match=r"0\.21\.x, 0\.33\.x") as info:
        api_generation(release)
    assert release in str(info.value)


def _config(extra: dict, **kw):
    return offload_config(
        extra,
        layout=kw.get("layout", LAYOUT),
        block_size=kw.get("block_size"),
        enable_events=kw.get("enable_events", False),
        engine_id=kw.get("engine_id", "engine-1"),
    )


def test_our_keys_are_taken_and_vllms_own_keys_are_left_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    extra = {
        "spec_name": "KVCacheOffloadSpec",
        "spec_module_path": "kvcache_offload.integrations.vllm",
        "cpu_bytes_to_use": "2GiB",
        "eviction_policy": "arc",
        "store_threshold": 2,
        "offload_prompt_only": True,
    }
    with caplog.at_level(logging.WARNING):
        config = _config(extra)
    assert caplog.text == ""
    assert config.cpu_bytes_to_use == 2 * 1024**3
    assert config.eviction_policy == "arc"
    assert config.store_threshold == 2
    assert config.spec_name == "CPUOffloadingSpec"
    assert config.spec_module_path is None


def test_foreign_keys_are_logged_not_rejected(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        config = _config({"cpu_bytes_to_use": 1 << 30, "other_tool_key": 3})
    assert config.cpu_bytes_to_use == 1 << 30
    assert "other_tool_key" in caplog.text


def test_vllm_decides_layout_block_size_and_events(caplog: pytest.LogCaptureFixture) -> None:
    extra = {"enable_events": True, "layout": {"bytes_per_block": 1}}
    with caplog.at_level(logging.WARNING):
        config = _config(extra, block_size=64, enable_events=False)
    assert config.enable_events is False
    assert config.layout == LAYOUT
    assert config.block_size == 64
    assert "enable_events" in caplog.text and "layout" in caplog.text


def test_a_shared_region_is_named_after_the_engine_unless_named() -> None:
    assert _config({"shared_region": True}, engine_id="a b/c").region_name == "vllm-a-b-c"
    named = _config({"shared_region": True, "region_name": "mine"})
    assert named.region_name == "mine"
    assert _config({}).region_name is None


def test_bad_values_of_our_keys_raise_config_errors() -> None:
    with pytest.raises(ConfigError, match="cpu_bytes_to_use"):
        _config({"cpu_bytes_to_use": -1})


def test_a_moved_settings_old_key_still_works_and_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING), pytest.warns(DeprecationWarning):
        cfg = _config({"gc_freeze": False, "transfer": {"batch_min_bytes": "8MiB"}})
    assert cfg.transfer.gc_freeze is False
    assert cfg.transfer.batch_min_bytes == 8 * 1024**2
    assert "'gc_freeze'" in caplog.text and "transfer" in caplog.text
