"""The modules that ship compiled (mypyc), and the switch back to their Python sources.

The manager and its eviction policies (with the helpers they share) run once per scheduler
step for every block, so they are compiled to C extensions with mypyc when the package is
built (``setup.py``); the ``.py`` files stay next to the extensions and are the single
source. Setting
``KVCACHE_OFFLOAD_PURE_PYTHON=1`` before the first import of ``kvcache_offload`` loads the
sources instead (for debugging, line profilers, or to compare both); a build without a C
compiler, or with ``KVCACHE_OFFLOAD_COMPILE=0``, has only the sources.

Stdlib only: ``setup.py`` reads :data:`COMPILED_MODULES` and :data:`C_EXTENSIONS` from this
file before any dependency is installed.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from pathlib import Path
from types import ModuleType

__all__ = [
    "COMPILED_MODULES",
    "C_EXTENSIONS",
    "PURE_PYTHON_ENV",
    "compiled_modules",
    "pure_python_requested",
]

COMPILED_MODULES: tuple[str, ...] = (
    "kvcache_offload.control.policies.base",
    "kvcache_offload.control.policies.lru",
    "kvcache_offload.control.policies.arc",
    "kvcache_offload.control.policies._ghosts",
    "kvcache_offload.control.policies._prefix_batch",
    "kvcache_offload.control.policies._stamp_queue",
    "kvcache_offload.control.policies._mark_queue",
    "kvcache_offload.control.policies._mini_cache",
    "kvcache_offload.control.policies._mini_sim",
    "kvcache_offload.control.policies._alru_log",
    "kvcache_offload.control.policies._alru_tails",
    "kvcache_offload.control.policies._alru_victims",
    "kvcache_offload.control.policies.alru",
    "kvcache_offload.control.policies.s3fifo",
    "kvcache_offload.control.policies.sieve",
    "kvcache_offload.control.policies.slru",
    "kvcache_offload.control.policies.lru2",
    "kvcache_offload.control.policies._shadow_race",
    "kvcache_offload.control.policies.adaptive",
    "kvcache_offload.control._manager_io",
    "kvcache_offload.control.manager_stats",
    "kvcache_offload.control._chosen_ahead",
    "kvcache_offload.control._caller_hints",
    "kvcache_offload.control._eviction",
    "kvcache_offload.control._fences",
    "kvcache_offload.control.manager",
)
"""Compiled together, in one mypyc group: the manager's hot path never leaves C for them."""

_UNITS_HEADER = "kvcache_offload/dataplane/copy/_units.h"
C_EXTENSIONS: dict[str, tuple[str, ...]] = {
    "kvcache_offload.dataplane.copy._hostcopy": (
        "kvcache_offload/dataplane/copy/_hostcopy.c",
        _UNITS_HEADER,
    ),
    "kvcache_offload.control.policies._native_duel": (
        "kvcache_offload/control/policies/_native_duel.c",
    ),
    "kvcache_offload.dataplane.copy._kernel_issue": (
        "kvcache_offload/dataplane/copy/_kernel_issue.c",
        _UNITS_HEADER,
    ),
}
"""The hand-written C extensions: module -> its source, then the headers it includes (paths
from the project root). Each is optional (its module's Python code is the fallback). One
table for the build, the setup script's rebuild check and the staleness test, so an edited
header rebuilds what includes it."""

PURE_PYTHON_ENV = "KVCACHE_OFFLOAD_PURE_PYTHON"


def pure_python_requested() -> bool:
    return os.environ.get(PURE_PYTHON_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class _SourceFinder(MetaPathFinder):
    """Finds the ``.py`` source of a compiled module even where its extension sits beside it."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in COMPILED_MODULES or path is None:
            return None
        leaf = fullname.rpartition(".")[2] + ".py"
        for entry in path:
            source = Path(entry) / leaf
            if source.is_file():
                return importlib.util.spec_from_file_location(fullname, source)
        return None


def _install_source_finder() -> None:
    if not any(isinstance(finder, _SourceFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _SourceFinder())


def compiled_modules() -> dict[str, bool]:
    """Each module of :data:`COMPILED_MODULES` -> whether the imported one is compiled."""
    out: dict[str, bool] = {}
    for name in COMPILED_MODULES:
        module = importlib.import_module(name)
        origin = getattr(module, "__file__", None) or ""
        out[name] = origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
    return out


if pure_python_requested():
    _install_source_finder()
