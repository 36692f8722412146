"""The service installs as ``kvcache_offload_service`` (its sources stay in ``api/``), so no
module of it may import itself as ``api``: that name exists only in a checkout."""

from __future__ import annotations

import ast
from pathlib import Path

SERVICE = Path(__file__).resolve().parents[2] / "api"


def _absolute_self_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0] == "api"]
    return found


def test_no_service_module_imports_itself_as_api():
    offenders = [hit for p in sorted(SERVICE.rglob("*.py")) for hit in _absolute_self_imports(p)]
    assert offenders == []


def test_the_check_sees_an_absolute_self_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from api.limits import RequestLimitError\n")
    assert _absolute_self_imports(bad) == ["bad.py:2 api.limits"]
