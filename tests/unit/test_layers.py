"""The layers of docs/architecture.md, checked on the source: imports point down only, and no
two modules import each other in a circle.

Read from the source text (``ast``), so the check covers optional extras and GPU modules that
cannot be imported here. A module may import its own layer and the layers below it. Imports
under ``if TYPE_CHECKING:`` are annotations, not dependencies, and are left out; imports inside
functions are dependencies too (they run), so they count for the layer order, but not for
circles (they do not run while the importing module loads).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import kvcache_offload
import kvcache_offload.contracts as contracts
from kvcache_offload.contracts import (
    handler,
    kv_caches,
    load_store_spec,
    manager,
    offload_key,
    spec,
)

ROOT = Path(kvcache_offload.__file__).parent
PACKAGE = "kvcache_offload"

LAYERS: list[tuple[str, set[str]]] = [
    (
        "basics",
        {
            "errors",
            "config",
            "_config_compat",
            "_config_file",
            "tuning",
            "extras",
            "_imports",
            "_registry",
            "_compiled",
            "_closing",
        },
    ),
    ("contracts", {"contracts", "keys"}),
    ("control plane", {"control"}),
    ("policy lab", {"lab"}),
    ("data plane", {"dataplane"}),
    ("tiers", {"tiers"}),
    ("engine events", {"events"}),
    ("KV events for routers", {"kv_events"}),
    ("async core", {"aio"}),
    (
        "service and entry points",
        {
            "client",
            "cli",
            "__main__",
            "integrations",
            "config_reference",
            "",
        },
    ),
]
"""Bottom to top; the names are the first part after ``kvcache_offload.`` ("" is the package's
own ``__init__``, which re-exports from the layers below it)."""

_RANK = {part: rank for rank, (_name, parts) in enumerate(LAYERS) for part in parts}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (ROOT.parent / rel).with_suffix(".py").exists() or (ROOT.parent / rel).is_dir()


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module level) for each runtime import of our package."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    top_level = {id(n) for n in tree.body}
    out: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # "from pkg import sub" imports the submodule pkg.sub when there is one
            names = [
                f"{node.module}.{alias.name}"
                if _is_module(f"{node.module}.{alias.name}")
                else node.module
                for alias in node.names
            ]
        else:
            continue
        out += [(n, id(node) in top_level) for n in names if n.split(".")[0] in (PACKAGE, "api")]
    return out


def _layer(module: str) -> int:
    parts = module.split(".")
    if parts[0] == "api":  # the HTTP service sits on top of the whole library
        return len(LAYERS)
    return _RANK[parts[1] if len(parts) > 1 else ""]


@functools.cache
def _graph() -> dict[str, list[tuple[str, bool]]]:
    return {_module_name(p): _imports(p) for p in sorted(ROOT.rglob("*.py"))}


def test_every_module_belongs_to_a_layer() -> None:
    unknown = {m for m in _graph() if m.split(".")[1:2] and m.split(".")[1] not in _RANK}
    assert not unknown, f"place these in LAYERS (and in docs/architecture.md): {unknown}"


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = [
        f"{src} ({_layer(src)}) imports {dst} ({_layer(dst)}): see LAYERS"
        for src, imports in _graph().items()
        for dst, _top in imports
        if _layer(dst) > _layer(src)
    ]
    assert not upward, "\n".join(upward)


def test_module_level_imports_form_no_circle() -> None:
    graph_names = set(_graph())
    graph = {
        src: {dst for dst, top in imports if top and dst != src and dst in graph_names}
        for src, imports in _graph().items()
    }
    # A package's __init__ importing its own submodules is how packages re-export; the
    # circle that matters is between modules, so edges into a package from inside it go.
    for src, dsts in graph.items():
        graph[src] = {d for d in dsts if not src.startswith(d + ".")}
    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_the_contracts_package_exports_exactly_what_its_modules_export() -> None:
    modules = (handler, kv_caches, load_store_spec, manager, offload_key, spec)
    expected = sorted(name for module in modules for name in module.__all__)
    assert sorted(contracts.__all__) == expected
    assert all(getattr(contracts, name) is not None for name in expected)
