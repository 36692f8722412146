"""Where the research scripts write their JSON: beside the benchmarks' (``bench/out/``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench._common import write_json as _write_json

__all__ = ["write_json"]


def write_json(name: str, payload: dict[str, Any]) -> Path:
    """``bench._common.write_json`` with the command named ``python -m research.<name>``."""
    return _write_json(name, payload, package="research")
