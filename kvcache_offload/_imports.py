"""Resolve "package.module:Name" (or "package.module.Name") strings to objects."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def import_object(path: str) -> object:
    """Import ``path``; raises ImportError or AttributeError with the path in the message."""
    module_path, sep, attr = path.partition(":")
    if not sep:
        module_path, _, attr = path.rpartition(".")
    if not module_path or not attr:
        raise ImportError(f"{path!r} is not of the form 'package.module:Name'")
    module = importlib.import_module(module_path)
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise AttributeError(f"module {module_path!r} has no attribute {attr!r}") from exc


def lazy_exports(package: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """A package's module ``__getattr__`` (PEP 562): ``table[name]`` is the module that defines
    ``name``, imported on first access, so importing the package imports none of them."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
