"""The control plane imports without torch, so schedulers and CLIs stay light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvcache_offload

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


def test_the_package_exports_the_embedded_api_and_stays_torch_free_until_used() -> None:
    code = (
        "import sys\n"
        "import kvcache_offload as k\n"
        "from kvcache_offload import (KVCacheLayout, OffloadConfig, OffloadEngine,\n"
        "    ConfigError, OffloadError, load_config, make_offload_key, __version__)\n"
        "assert 'torch' not in sys.modules\n"
        "assert __version__ == '0.2.0'\n"
        "from kvcache_offload import layouts\n"
        "assert callable(layouts.blocks_first_per_layer)\n"
        "assert set(k.__all__) <= set(dir(k))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# -- the import graph, read from the source ------------------------------------------------

_REPO = Path(kvcache_offload.__file__).resolve().parents[1]
_SERVICE = "kvcache_offload_service"  # the api/ folder's import name


def _runtime_imports(path: Path, package: str) -> list[str]:
    """Absolute names of every import that runs (module level or deferred inside a function);
    imports under ``if TYPE_CHECKING:`` are annotations only and are left out."""
    tree = ast.parse(path.read_text())
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    here = path.relative_to(_REPO).with_suffix("").parts
    if here[-1] == "__init__":
        here = here[:-1]
    base = [package if here[0] == "api" else here[0], *here[1:]]
    out: list[str] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base[: len(base) - node.level + (path.name == "__init__.py")]
                module = ".".join([*parent, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            out += [f"{module}.{alias.name}" for alias in node.names]
    return out


def _package_of(name: str) -> str | None:
    """The first-level package or module an imported name belongs to
    (``kvcache_offload.aio``, ``kvcache_offload.config``, ``kvcache_offload`` for the
    package's ``__init__``) or the service; None when not ours."""
    parts = name.split(".")
    if parts[0] in (_SERVICE, "api"):
        return _SERVICE
    if parts[0] != "kvcache_offload":
        return None
    if len(parts) > 1 and (
        (_REPO / "kvcache_offload" / parts[1]).is_dir()
        or (_REPO / "kvcache_offload" / f"{parts[1]}.py").exists()
    ):
        return f"kvcache_offload.{parts[1]}"
    return "kvcache_offload"


def _sources() -> dict[str, Path]:
    """Package -> its files, for the library's packages and the service."""
    files = sorted((_REPO / "kvcache_offload").rglob("*.py")) + sorted(
        (_REPO / "api").rglob("*.py")
    )
    return {str(p.relative_to(_REPO)): p for p in files}


def _package_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for rel, path in _sources().items():
        src = _package_of(
            _SERVICE if rel.startswith("api/") else rel.removesuffix(".py").replace("/", ".")
        )
        assert src is not None
        for name in _runtime_imports(path, _SERVICE):
            dst = _package_of(name)
            if dst is not None and dst != src:
                edges.setdefault(src, set()).add(dst)
    return edges


def test_the_library_never_imports_the_service() -> None:
    offenders = [
        f"{rel} imports {name}"
        for rel, path in _sources().items()
        if rel.startswith("kvcache_offload/")
        for name in _runtime_imports(path, _SERVICE)
        if _package_of(name) == _SERVICE
    ]
    assert not offenders, "\n".join(offenders)


def test_packages_import_each_other_in_no_circle() -> None:
    # Deferred imports count (they run); each top-level module (config, errors, CLI) is a
    # node of its own, and the package's ``__init__`` is one too.
    edges = _package_edges()
    circles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                circles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not circles, "\n".join(" -> ".join(c) for c in circles)
