"""Reading a config file (TOML, JSON or YAML) into a plain mapping for ``load_config``."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from kvcache_offload.errors import ConfigError

__all__ = ["read_config_file"]


def read_config_file(path: Path) -> dict[str, Any]:
    """The mapping in ``path`` (under a ``kvcache_offload`` key if it has one)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    try:
        if path.suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(
                f"config file {path} has an unknown type {path.suffix or '(no suffix)'!r}: use "
                f".toml, .json, .yaml or .yml"
            )
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"cannot parse config file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    return data.get("kvcache_offload", data)
