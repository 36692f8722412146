"""The control plane imports without torch, so schedulers and CLIs stay light."""

from __future__ import annotations

import subprocess
import sys

CONTROL_PLANE = [
    "kvcache_offload",
    "kvcache_offload.base",
    "kvcache_offload.cpu.manager",
    "kvcache_offload.cpu.policies",
    "kvcache_offload.reuse_manager",
    "kvcache_offload.factory",
    "kvcache_offload.config",
]


def test_control_plane_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in CONTROL_PLANE)
        + "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
        + "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_engine_imports_without_the_tier_and_server_extras() -> None:
    """`pip install kvcache-offload` (no extras) must be able to import the engine: the tier
    clients (redis, xxhash) and the web stack load only when a tier or the service is used."""
    code = (
        "import sys\n"
        "import kvcache_offload.aio\n"
        "import kvcache_offload.tiers\n"
        "bad = [m for m in ('redis', 'xxhash', 'fastapi', 'uvicorn') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
