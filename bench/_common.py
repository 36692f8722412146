"""Shared bits of the benchmarks: where results go and what describes the machine."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

OUT_DIR = Path(__file__).resolve().parent / "out"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """Enough to tell two result files apart: host, CPU, load, interpreter and packages."""
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average": load,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "versions": {d: _version(d) for d in ("kvcache-offload", "numpy", "matplotlib")},
        "git_commit": _git_commit(),
    }


def write_json(name: str, payload: dict[str, Any], package: str = "bench") -> Path:
    """Write ``payload`` plus machine and command (``python -m <package>.<name>``) to
    ``bench/out/<name>-<utc time>.json``."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = OUT_DIR / f"{name}-{stamp}.json"
    data = {
        "benchmark": name,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, "-m", f"{package}.{name}", *sys.argv[1:]]),
        "machine": machine_info(),
        **payload,
    }
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
