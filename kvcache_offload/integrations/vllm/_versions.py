"""Which vLLM releases the plug-in speaks to, and which of vLLM's two spec APIs each one has.

vLLM changed its offloading-spec API between the releases we support: 0.21 builds a spec from
``(vllm_config, kv_cache_config)`` and asks it for handlers (``get_handlers``); later releases
build it from an ``OffloadingConfig`` and ask it for one worker (``get_worker`` with
``submit_store``/``submit_load``) and a manager whose ``lookup`` returns ``LookupResult``.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Literal

from kvcache_offload.errors import ConfigError

__all__ = ["SUPPORTED_VLLM", "ApiGeneration", "api_generation"]

ApiGeneration = Literal["handlers", "worker"]

SUPPORTED_VLLM: dict[str, ApiGeneration] = {"0.21": "handlers", "0.33": "worker"}
"""Release series (major.minor) -> the spec API it has. Each one is tested in CI."""


def api_generation(vllm_version: str | None = None) -> ApiGeneration:
    """The spec API of ``vllm_version`` (default: installed vLLM); ConfigError if unsupported."""
    if vllm_version is None:
        try:
            vllm_version = version("vllm")
        except PackageNotFoundError:
            raise ConfigError(
                "kvcache_offload.integrations.vllm needs vLLM installed "
                f"(pip install 'kvcache-offload[vllm]'; supported: {_supported()})"
            ) from None
    series = ".".join(vllm_version.split("+")[0].split(".")[:2])
    generation = SUPPORTED_VLLM.get(series)
    if generation is None:
        raise ConfigError(
            f"vLLM {vllm_version} is not supported by kvcache_offload.integrations.vllm; "
            f"supported releases: {_supported()}"
        )
    return generation


def _supported() -> str:
    return ", ".join(f"{series}.x" for series in SUPPORTED_VLLM)
