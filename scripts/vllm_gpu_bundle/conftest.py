"""The one fixture of vLLM's tests/conftest.py that test_gpu_worker.py uses, without the rest
of that conftest (it imports vLLM's whole engine, model helpers and media assets)."""

import pytest


@pytest.fixture
def default_vllm_config():
    """A default VllmConfig as the current config, like vLLM's fixture of that name."""
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config
