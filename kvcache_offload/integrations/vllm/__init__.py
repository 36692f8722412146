"""vLLM plug-in: vLLM's ``OffloadingConnector`` runs on this library through its config alone.

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KVCacheOffloadSpec",
        "spec_module_path": "kvcache_offload.integrations.vllm",
        "cpu_bytes_to_use": 8589934592, "eviction_policy": "arc"}}'

``KVCacheOffloadSpec`` subclasses the installed vLLM's ``OffloadingSpec`` (vLLM's factory checks
that) and hands vLLM this library's manager, eviction policies and handlers. The other keys of
the extra config are this library's :class:`~kvcache_offload.config.OffloadConfig` fields. Only
the vLLM releases in :data:`SUPPORTED_VLLM` are accepted: under any other, asking for
``KVCacheOffloadSpec`` raises :class:`~kvcache_offload.errors.ConfigError` naming them. vLLM is
imported on that first access only, so the helpers import without it.
"""

from __future__ import annotations

from typing import Any

from kvcache_offload.integrations.vllm._versions import SUPPORTED_VLLM, api_generation

__all__ = ["SUPPORTED_VLLM", "KVCacheOffloadSpec"]


def __getattr__(name: str) -> Any:
    """Import the installed vLLM (and the matching adapter) only when the spec is asked for."""
    if name != "KVCacheOffloadSpec":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if api_generation() == "handlers":
        from kvcache_offload.integrations.vllm import _handlers_api as adapter
    else:
        from kvcache_offload.integrations.vllm import _worker_api as adapter  # type: ignore[no-redef]
    return adapter.KVCacheOffloadSpec
