"""vLLM's ``kv_connector_extra_config`` -> this library's :class:`OffloadConfig`.

The extra config is shared with vLLM's connector, so it holds keys vLLM reads itself
(``block_size``, ``blocks_per_chunk``, ...) and may hold keys of other tools. Our keys go into
the config (environment variables still apply below them); vLLM's are left to vLLM; any other
key is logged as ignored, never rejected. What vLLM decides is not ours to set: the KV-cache
layout (from its ``KVCacheConfig``), the offloaded block size (from its spec) and whether events
are emitted (vLLM drains them only when its own KV events are on).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from kvcache_offload.config import KVCacheLayout, OffloadConfig, load_config

__all__ = ["offload_config"]

logger = logging.getLogger(__name__)

VLLM_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "block_size",
        "blocks_per_chunk",
        "offload_prompt_only",
        "self_describing_kv_events",
    }
)
"""Keys vLLM's connector reads itself."""

DECIDED_BY_VLLM = frozenset({"layout", "enable_events", "block_size"})

INNER_SPEC = "CPUOffloadingSpec"
"""This library's spec that does the work behind the vLLM-facing adapter."""


def offload_config(
    extra_config: Mapping[str, Any],
    *,
    layout: KVCacheLayout,
    block_size: int | None,
    enable_events: bool,
    engine_id: str | None,
) -> OffloadConfig:
    """Our config for a vLLM engine; ``block_size`` is the offloaded block size vLLM computed."""
    ours: dict[str, Any] = {}
    ignored = []
    for key, value in extra_config.items():
        if key in VLLM_KEYS:
            continue
        if key not in OffloadConfig.model_fields:
            ignored.append(key)
        elif key in DECIDED_BY_VLLM:
            logger.warning("kv_connector_extra_config[%r] is decided by vLLM; ignored", key)
        else:
            ours[key] = value
    if ignored:
        logger.warning(
            "kv_connector_extra_config keys not used by kvcache-offload (ignored): %s",
            ", ".join(sorted(ignored)),
        )
    if ours.get("shared_region") and not ours.get("region_name") and engine_id:
        ours["region_name"] = "vllm-" + re.sub(r"[^A-Za-z0-9_.-]", "-", engine_id)[:120]
    return load_config(
        **ours,
        spec_name=INNER_SPEC,
        spec_module_path=None,
        layout=layout,
        block_size=block_size,
        enable_events=enable_events,
    )
