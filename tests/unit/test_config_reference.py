"""docs/configuration.md is generated from the config models and must match them."""

from __future__ import annotations

from pathlib import Path

from kvcache_offload.config import OffloadConfig
from kvcache_offload.config_reference import render
from kvcache_offload.tuning import TransferTuning

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_committed_configuration_page_is_current() -> None:
    assert PAGE.read_text() == render(), (
        "docs/configuration.md is stale: run "
        "`python -m kvcache_offload.config_reference --write docs/configuration.md`"
    )


def test_the_page_lists_every_setting_with_its_environment_variable() -> None:
    page = render()
    for name in OffloadConfig.model_fields:
        assert f"`KVCACHE_OFFLOAD_{name.upper()}`" in page
    for name in TransferTuning.model_fields:
        assert f"`KVCACHE_OFFLOAD_TRANSFER__{name.upper()}`" in page
