"""Modules moved by the renovation keep their old import paths, with a warning, as the same
module objects (so monkeypatching, isinstance checks and registries see one thing)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvcache_offload._moved import MOVED


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("kvcache_offload.cpu.manager", "kvcache_offload.control.manager"),
        ("kvcache_offload.cpu.policies.lru", "kvcache_offload.control.policies.lru"),
        ("kvcache_offload.reuse_manager", "kvcache_offload.control.reuse_filter"),
        ("kvcache_offload.factory", "kvcache_offload.control.spec_factory"),
        ("kvcache_offload.cpu.spec", "kvcache_offload.dataplane.spec"),
        ("kvcache_offload.cpu.copy.plan", "kvcache_offload.dataplane.copy.plan"),
        ("kvcache_offload.replay.trace", "kvcache_offload.lab.trace"),
    ],
)
def test_an_old_module_path_is_the_new_module_and_warns(old: str, new: str) -> None:
    result = run(
        "import importlib, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    old = importlib.import_module({old!r})\n"
        f"new = importlib.import_module({new!r})\n"
        "assert old is new\n"
        "assert any(issubclass(w.category, DeprecationWarning) and 'moved to' in str(w.message)\n"
        "           for w in caught), [str(w.message) for w in caught]\n"
        f"assert new.__spec__.name == {new!r}\n"
    )
    assert result.returncode == 0, result.stderr


def test_old_package_names_still_export_what_they_did() -> None:
    result = run(
        "import warnings\n"
        "warnings.simplefilter('ignore')\n"
        "from kvcache_offload.cpu import CPUOffloadingManager, CPULoadStoreSpec, layouts\n"
        "from kvcache_offload.worker.worker import OffloadingWorker, TransferResult\n"
        "from kvcache_offload.worker import OffloadingHandler\n"
        "from kvcache_offload.worker import worker\n"
        "assert worker.OffloadingWorker is OffloadingWorker\n"
        "from kvcache_offload.base import OffloadKey, make_offload_key, OffloadingSpec\n"
        "import kvcache_offload.control.manager as m\n"
        "import kvcache_offload.contracts as c\n"
        "assert CPUOffloadingManager is m.CPUOffloadingManager\n"
        "assert CPULoadStoreSpec is c.CPULoadStoreSpec and OffloadingSpec is c.OffloadingSpec\n"
        "assert layouts.__name__ == 'kvcache_offload.dataplane.layouts'\n"
    )
    assert result.returncode == 0, result.stderr


def test_the_package_itself_imports_nothing_through_an_old_path() -> None:
    names = " ".join(sorted(MOVED))
    result = run(
        "import sys, warnings\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "import kvcache_offload, kvcache_offload.aio, kvcache_offload.lab, kvcache_offload.tiers\n"
        "import kvcache_offload.dataplane.spec, kvcache_offload.control.policies\n"
        f"bad = [m for m in {names.split()!r} if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    assert result.returncode == 0, result.stderr
