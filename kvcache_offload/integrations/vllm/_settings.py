"""vLLM's ``kv_connector_extra_config`` -> this library's :class:`OffloadConfig`.

The extra config is shared with vLLM's connector, so it holds keys vLLM reads itself
(``block_size``, ``blocks_per_chunk``, ...) and may hold keys of other tools. Our keys go into
the config (environment variables still apply below them); vLLM's are left to vLLM; any other
key is logged as ignored, never rejected. What vLLM decides is not ours to set: the KV-cache
layout (from its ``KVCacheConfig``), the offloaded block size (from its spec) and whether events
are emitted (vLLM drains them only when its own KV events are on).

Two keys belong to the adapter itself: ``observability_port`` (off unless set; 0 picks a free
port) and ``observability_host`` (default 127.0.0.1) start the side port
(:func:`side_port_settings`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvcache_offload.config import KVCacheLayout, OffloadConfig, load_config
from kvcache_offload.errors import ConfigError
from kvcache_offload.tuning import MOVED_TO_TRANSFER, REMOVED_FIELDS

__all__ = ["SidePortSettings", "offload_config", "side_port_settings"]

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

ADAPTER_KEYS = frozenset({"observability_port", "observability_host"})
"""Keys of the adapter itself (the side port), not of :class:`OffloadConfig`."""

DEFAULT_OBSERVABILITY_HOST = "127.0.0.1"

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
        if key in VLLM_KEYS or key in ADAPTER_KEYS:
            continue
        if key in MOVED_TO_TRANSFER or key in REMOVED_FIELDS:
            logger.warning(
                "kv_connector_extra_config[%r] is a 0.1 name: %s", key,
                f"use {{'transfer': {{'{MOVED_TO_TRANSFER[key]}': ...}}}}"
                if key in MOVED_TO_TRANSFER else "it is removed and ignored",
            )  # fmt: skip
            ours[key] = value  # load_config maps (or drops) it for one release
        elif key not in OffloadConfig.model_fields:
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


@dataclass(frozen=True)
class SidePortSettings:
    """Where the observability side port listens (port 0: any free port)."""

    host: str
    port: int


def side_port_settings(extra_config: Mapping[str, Any]) -> SidePortSettings | None:
    """The side port asked for by ``observability_port``/``_host``, or None (the default)."""
    port = extra_config.get("observability_port")
    host = extra_config.get("observability_host", DEFAULT_OBSERVABILITY_HOST)
    if port is None:
        if "observability_host" in extra_config:
            logger.warning("observability_host is set without observability_port; no side port")
        return None
    if isinstance(port, str) and port.strip().isdigit():
        port = int(port)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(
            f"kv_connector_extra_config['observability_port'] must be a port number "
            f"0-65535 (0: any free port), got {port!r}"
        )
    if not isinstance(host, str) or not host:
        raise ConfigError(
            f"kv_connector_extra_config['observability_host'] must be a host name or address, "
            f"got {host!r}"
        )
    return SidePortSettings(host=host, port=port)
