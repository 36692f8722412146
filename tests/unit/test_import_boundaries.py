"""The control plane imports without torch, so schedulers and CLIs stay light."""

from __future__ import annotations

import subprocess
import sys

CONTROL_PLANE = [
    "kvcache_offload",
    "kvcache_offload.control.manager",
    "kvcache_offload.control.policies",
    "kvcache_offload.control.reuse_filter",
    "kvcache_offload.control.spec_factory",
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


def test_policy_modules_load_only_when_a_configuration_asks_for_them() -> None:
    code = (
        "import sys\n"
        "import kvcache_offload\n"
        "from kvcache_offload.control.policies import get_cache_policy_cls\n"
        "prefix = 'kvcache_offload.control.policies.'\n"
        "loaded = lambda: sorted(m[len(prefix):] for m in sys.modules if m.startswith(prefix))\n"
        "before = loaded()\n"
        "assert 'sieve' not in before and 'slru' not in before and 'alru' not in before, before\n"
        "get_cache_policy_cls('sieve')\n"
        "assert 'sieve' in loaded() and 'slru' not in loaded(), loaded()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
