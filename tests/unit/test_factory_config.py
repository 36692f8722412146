"""Spec factory registry and configuration loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcache_offload import (
    ConfigError,
    CPUOffloadingManager,
    FilterReusedOffloadingManager,
    KVCacheLayout,
    OffloadConfig,
    OffloadingSpecFactory,
    TransferTuning,
    UnknownSpecError,
    load_config,
)
from kvcache_offload.control.policies import AdaptiveCachePolicy
from kvcache_offload.dataplane.spec import CPUOffloadingSpec


@pytest.fixture
def restore_registry():  # type: ignore[no-untyped-def]
    saved = OffloadingSpecFactory._registry.snapshot()
    yield
    OffloadingSpecFactory._registry.restore(saved)


def test_default_spec_is_the_cpu_spec_sized_from_the_byte_budget() -> None:
    layout = KVCacheLayout(gpu_block_sizes=[16], bytes_per_block=1024, world_size=2)
    spec = OffloadingSpecFactory.create_spec(
        load_config(cpu_bytes_to_use="1MiB", block_size=32), layout
    )
    assert isinstance(spec, CPUOffloadingSpec)
    assert spec.block_size_factor == 2
    assert spec.kv_bytes_per_offloaded_block == 1024 * 2 * 2
    assert spec.num_blocks == 1024**2 // (4096)
    assert spec.cpu_page_size_per_worker == 2048
    assert isinstance(spec.get_manager(), CPUOffloadingManager)
    assert spec.get_manager() is spec.get_manager()


def test_store_threshold_wraps_the_manager_in_the_reuse_filter() -> None:
    spec = OffloadingSpecFactory.create_spec(load_config(store_threshold=2))
    assert isinstance(spec.get_manager(), FilterReusedOffloadingManager)


def test_default_config_builds_a_manager_running_the_adaptive_policy() -> None:
    assert OffloadConfig.model_fields["eviction_policy"].default == "adaptive"
    manager = OffloadingSpecFactory.create_spec(load_config()).get_manager()
    assert isinstance(manager, CPUOffloadingManager)
    assert isinstance(manager.policy, AdaptiveCachePolicy)
    assert manager.stats().policy == "adaptive"


def test_offloaded_block_size_must_be_a_multiple_of_the_gpu_block_size() -> None:
    with pytest.raises(ConfigError, match="multiple"):
        OffloadingSpecFactory.create_spec(load_config(block_size=24))


def test_unknown_spec_without_module_path_is_rejected(restore_registry: None) -> None:
    with pytest.raises(UnknownSpecError, match="Nope"):
        OffloadingSpecFactory.create_spec(load_config(spec_name="Nope"))


def test_unregistered_spec_loads_from_its_module_path(restore_registry: None) -> None:
    OffloadingSpecFactory.unregister_spec("CPUOffloadingSpec")
    spec = OffloadingSpecFactory.create_spec(
        load_config(spec_module_path="kvcache_offload.dataplane.spec")
    )
    assert isinstance(spec, CPUOffloadingSpec)


def test_duplicate_registration_is_rejected(restore_registry: None) -> None:
    with pytest.raises(ConfigError, match="already registered"):
        OffloadingSpecFactory.register_spec("CPUOffloadingSpec", "x", "Y")


def test_config_sizes_accept_human_strings() -> None:
    assert int(load_config(cpu_bytes_to_use="4GiB").cpu_bytes_to_use) == 4 * 1024**3


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cpu_bytes_to_use", 0),
        ("cpu_bytes_to_use", "lots"),
        ("block_size", -16),
        ("max_tracker_size", 0),
        ("unknown_key", 1),
    ],
)
def test_invalid_config_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        load_config(**{field: value})


def test_config_precedence_is_arguments_then_environment_then_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "offload.json"
    path.write_text(json.dumps({"eviction_policy": "arc", "store_threshold": 3, "port": 9}))
    monkeypatch.setenv("KVCACHE_OFFLOAD_STORE_THRESHOLD", "4")
    monkeypatch.setenv("KVCACHE_OFFLOAD_LAYOUT__WORLD_SIZE", "2")
    cfg = load_config(path, port=10)
    assert cfg.eviction_policy == "arc"  # file
    assert cfg.store_threshold == 4  # env beats file
    assert cfg.port == 10  # argument beats file
    assert cfg.layout.world_size == 2


def test_config_file_in_toml_and_bad_files_give_clear_errors(tmp_path: Path) -> None:
    good = tmp_path / "c.toml"
    good.write_text('eviction_policy = "arc"\ncpu_bytes_to_use = "2GiB"\n')
    assert load_config(good).eviction_policy == "arc"
    bad = tmp_path / "c.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.json")


def test_from_dict_accepts_vllm_extra_config_keys() -> None:
    cfg = OffloadConfig.from_dict(
        {"cpu_bytes_to_use": 1 << 30, "eviction_policy": "arc", "store_threshold": 2}
    )
    assert cfg.eviction_policy == "arc"


def test_staged_when_busy_takes_a_direction_from_the_environment_or_the_old_booleans(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert OffloadConfig().transfer.staged_when_busy == "mixed"
    spellings = (
        ("stores", "stores"),
        ("BOTH", "both"),
        ("Mixed", "mixed"),
        ("1", "both"),
        ("0", "off"),
    )
    for spelling, meaning in spellings:
        monkeypatch.setenv("KVCACHE_OFFLOAD_TRANSFER__STAGED_WHEN_BUSY", spelling)
        assert OffloadConfig().transfer.staged_when_busy == meaning
    monkeypatch.delenv("KVCACHE_OFFLOAD_TRANSFER__STAGED_WHEN_BUSY")
    assert TransferTuning(staged_when_busy=True).staged_when_busy == "both"
    with pytest.raises(ConfigError, match=r"transfer\.staged_when_busy"):
        OffloadConfig.from_dict({"transfer": {"staged_when_busy": "loads"}})


def test_staged_one_way_sizes_take_sizes_per_direction_and_zero_turns_them_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = OffloadConfig()
    assert config.transfer.staged_one_way_min_load_bytes == 5 * 1024**2
    assert config.transfer.staged_one_way_min_store_bytes == 8 * 1024**2
    monkeypatch.setenv("KVCACHE_OFFLOAD_TRANSFER__STAGED_ONE_WAY_MIN_LOAD_BYTES", "8MiB")
    monkeypatch.setenv("KVCACHE_OFFLOAD_TRANSFER__STAGED_ONE_WAY_MIN_STORE_BYTES", "0")
    config = OffloadConfig()
    assert config.transfer.staged_one_way_min_load_bytes == 8 * 1024**2
    assert config.transfer.staged_one_way_min_store_bytes == 0
    with pytest.raises(ConfigError, match="staged_one_way_min_store_bytes"):
        OffloadConfig.from_dict({"transfer": {"staged_one_way_min_store_bytes": -1}})


def test_transfer_knobs_keep_their_measured_defaults() -> None:
    t = OffloadConfig().transfer
    assert t.mechanism == "auto"
    assert t.staged_mixed_min_job_bytes == 5 * 1024**2
    assert t.completion_sleep_behind_s == 0.003
    assert t.completion_caller_looks is True
    assert t.evict_ahead_fraction == 1 / 32
    assert t.gc_freeze is True


@pytest.mark.parametrize(
    ("old", "new", "spelling", "value"),
    [
        ("TRANSFER_MECHANISM", "mechanism", "torch", "torch"),
        ("STAGED_WHEN_BUSY", "staged_when_busy", "1", "both"),
        ("STAGED_MIXED_MIN_JOB_BYTES", "staged_mixed_min_job_bytes", "2MiB", 2 * 1024**2),
        ("BATCH_MAX_BYTES", "batch_max_bytes", "16MiB", 16 * 1024**2),
        ("COMPLETION_SLEEP_BEHIND_S", "completion_sleep_behind_s", "0", 0),
        ("COMPLETION_CALLER_LOOKS", "completion_caller_looks", "false", False),
        ("EVICT_AHEAD_FRACTION", "evict_ahead_fraction", "0", 0),
        ("GC_FREEZE", "gc_freeze", "0", False),
    ],
)
def test_a_moved_settings_old_environment_variable_still_works_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, old: str, new: str, spelling: str, value: object
) -> None:
    monkeypatch.setenv(f"KVCACHE_OFFLOAD_{old}", spelling)
    with pytest.warns(DeprecationWarning, match=f"KVCACHE_OFFLOAD_TRANSFER__{new.upper()}"):
        config = load_config()
    assert getattr(config.transfer, new) == value


def test_the_new_environment_name_wins_over_the_old_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHE_OFFLOAD_GC_FREEZE", "0")
    monkeypatch.setenv("KVCACHE_OFFLOAD_TRANSFER__GC_FREEZE", "1")
    with pytest.warns(DeprecationWarning):
        assert load_config().transfer.gc_freeze is True


def test_a_moved_settings_old_keyword_and_file_key_still_work_with_a_warning(
    tmp_path: Path,
) -> None:
    with pytest.warns(DeprecationWarning, match="'transfer.mechanism'"):
        assert OffloadConfig(transfer_mechanism="dma").transfer.mechanism == "dma"
    with pytest.warns(DeprecationWarning, match="'transfer.batch_min_bytes'"):
        config = OffloadConfig.from_dict({"batch_min_bytes": "8MiB", "eviction_policy": "lru"})
    assert config.transfer.batch_min_bytes == 8 * 1024**2
    path = tmp_path / "c.toml"
    path.write_text('gc_freeze = false\n[transfer]\nbatch_max_bytes = "32MiB"\n')
    with pytest.warns(DeprecationWarning, match="'transfer.gc_freeze'"):
        config = load_config(path)
    assert (config.transfer.gc_freeze, config.transfer.batch_max_bytes) == (False, 32 * 1024**2)


def test_the_removed_dma_min_fragment_bytes_is_ignored_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.warns(DeprecationWarning, match="dma_min_fragment_bytes"):
        assert OffloadConfig.from_dict({"dma_min_fragment_bytes": "1MiB"})
    monkeypatch.setenv("KVCACHE_OFFLOAD_DMA_MIN_FRAGMENT_BYTES", "1MiB")
    with pytest.warns(DeprecationWarning, match="ignored"):
        load_config()


def test_file_environment_and_arguments_merge_inside_transfer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[transfer]\nbatch_max_bytes = "32MiB"\ngc_freeze = false\n')
    monkeypatch.setenv("KVCACHE_OFFLOAD_TRANSFER__GC_FREEZE", "true")
    config = load_config(path, transfer={"mechanism": "dma"})
    assert config.transfer.batch_max_bytes == 32 * 1024**2  # from the file
    assert config.transfer.gc_freeze is True  # the environment over the file
    assert config.transfer.mechanism == "dma"  # the argument


def test_every_setting_has_a_description_in_the_schema() -> None:
    schema = OffloadConfig.model_json_schema()
    for model in [schema, *schema["$defs"].values()]:
        for name, field in model["properties"].items():
            assert field.get("description"), f"{model['title']}.{name} has no description"


def test_batch_bounds_default_to_the_handlers_and_take_sizes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("torch")
    from kvcache_offload.dataplane.handlers.cuda import (
        DEFAULT_BATCH_MAX_BYTES,
        DEFAULT_BATCH_MIN_BYTES,
    )

    config = OffloadConfig().transfer
    assert (config.batch_min_bytes, config.batch_max_bytes) == (
        DEFAULT_BATCH_MIN_BYTES,
        DEFAULT_BATCH_MAX_BYTES,
    )
    monkeypatch.setenv("KVCACHE_OFFLOAD_TRANSFER__BATCH_MAX_BYTES", "16MiB")
    assert OffloadConfig().transfer.batch_max_bytes == 16 * 1024**2
    monkeypatch.delenv("KVCACHE_OFFLOAD_TRANSFER__BATCH_MAX_BYTES")
    with pytest.raises(ConfigError, match="batch_min_bytes"):
        OffloadConfig.from_dict(
            {"transfer": {"batch_min_bytes": "32MiB", "batch_max_bytes": "16MiB"}}
        )
    with pytest.raises(ConfigError, match="batch_max_bytes"):
        OffloadConfig.from_dict({"transfer": {"batch_max_bytes": 0}})


def test_every_cuda_option_of_the_config_reaches_the_handlers_constructor() -> None:
    # The CUDA handlers are built only on a GPU; this checks, without one, that every option
    # the spec passes them is a parameter of theirs, with the config's value.
    pytest.importorskip("torch")
    import inspect

    from kvcache_offload.dataplane.handlers.cuda import (
        CpuGpuOffloadingHandlers,
        SingleDirectionOffloadingHandler,
    )
    from kvcache_offload.dataplane.spec import cuda_handler_options

    config = OffloadConfig.from_dict(
        {"transfer": {"batch_min_bytes": "8MiB", "batch_max_bytes": "32MiB"}}
    )
    options = cuda_handler_options(config)
    parameters = inspect.signature(CpuGpuOffloadingHandlers).parameters
    assert set(options) <= set(parameters)
    one_direction = inspect.signature(SingleDirectionOffloadingHandler).parameters
    # the pair passes them on to each direction
    assert {"batch_min_bytes", "batch_max_bytes", "staged_mixed_min_job_bytes"} <= set(
        one_direction
    )
    assert options["staged_mixed_min_job_bytes"] == 5 * 1024**2
    assert options["batch_min_bytes"] == 8 * 1024**2
    assert options["batch_max_bytes"] == 32 * 1024**2
    assert options["staged_min_job_bytes"] == 256 * 1024**2
    assert options["staged_when_busy"] == "mixed"


def test_the_transfer_defaults_are_the_handlers_own() -> None:
    # Handlers built directly (without a config) and through the config behave alike.
    pytest.importorskip("torch")
    from kvcache_offload.dataplane.handlers.cuda import paths

    t = TransferTuning()
    assert t.staged_min_job_bytes == paths.DEFAULT_STAGED_MIN_JOB_BYTES
    assert t.staged_lone_min_load_bytes == paths.DEFAULT_STAGED_LONE_MIN_LOAD_BYTES
    assert t.staged_one_way_min_load_bytes == paths.DEFAULT_STAGED_ONE_WAY_MIN_LOAD_BYTES
    assert t.staged_one_way_min_store_bytes == paths.DEFAULT_STAGED_ONE_WAY_MIN_STORE_BYTES
    assert t.staged_mixed_min_job_bytes == paths.DEFAULT_STAGED_MIXED_MIN_JOB_BYTES
