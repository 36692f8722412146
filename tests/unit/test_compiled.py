"""The manager and its eviction policies ship compiled (mypyc); their sources are the fallback."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from kvcache_offload import CPUOffloadingManager, compiled_modules
from kvcache_offload._compiled import C_EXTENSIONS, COMPILED_MODULES, PURE_PYTHON_ENV
from kvcache_offload.control.policies import (
    CachePolicy,
    LRUCachePolicy,
)


def test_compiled_modules_are_all_or_nothing() -> None:
    # mypyc's extensions share one runtime library: a mix means a broken or stale build.
    states = compiled_modules()
    assert set(states) == set(COMPILED_MODULES)
    assert len(set(states.values())) == 1, states


def test_the_build_is_compiled_where_the_test_command_expects_it() -> None:
    # scripts/test.sh sets KVCACHE_OFFLOAD_EXPECT_COMPILED=1 (0 for its pure-Python pass).
    expected = os.environ.get("KVCACHE_OFFLOAD_EXPECT_COMPILED")
    states = compiled_modules()
    if expected == "1":
        assert all(states.values()), f"the install fell back to pure Python: {states}"
        # The C extensions beside them, built by the same step.
        from kvcache_offload.control.policies import _mini_sim

        assert _mini_sim.native_duel_available(), "the _native_duel extension is not built"
        from kvcache_offload.dataplane.copy.kernel_issue import kernel_issue_available

        assert kernel_issue_available(), "the _kernel_issue extension is not built"
    elif expected == "0":
        assert not any(states.values()), states
    else:
        assert set(states.values()) <= {True, False}


def test_extensions_are_not_older_than_their_sources() -> None:
    # An editable install keeps the extension beside the edited .py, which it shadows.
    for name in COMPILED_MODULES:
        module = importlib.import_module(name)
        origin = Path(module.__file__ or "")
        if origin.suffix == ".py":
            continue
        source = origin.parent / (name.rpartition(".")[2] + ".py")
        assert origin.stat().st_mtime >= source.stat().st_mtime, (
            f"{origin.name} is older than {source.name}: rebuild with ./scripts/setup.sh "
            f"or set {PURE_PYTHON_ENV}=1"
        )


ROOT = Path(__file__).resolve().parents[2]


def test_c_extensions_are_not_older_than_their_sources_and_headers() -> None:
    # An edited .c or header (the unit planner both copy extensions include) must not leave
    # the tests running the old extension. A missing one is the other test's business.
    checked = 0
    for name, files in C_EXTENSIONS.items():
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        built = Path(spec.origin)
        for source in files:
            path = ROOT / source
            assert path.is_file(), f"{source} (listed for {name}) does not exist"
            assert built.stat().st_mtime >= path.stat().st_mtime, (
                f"{built.name} is older than {path.name}: rebuild with ./scripts/setup.sh"
            )
        checked += 1
    if os.environ.get("KVCACHE_OFFLOAD_EXPECT_COMPILED") == "1":
        assert checked == len(C_EXTENSIONS)


def test_every_c_source_is_listed_and_shipped() -> None:
    # setup.py builds what C_EXTENSIONS lists and setup.sh rebuilds when those files change;
    # a source missing from the table, or from the sdist's MANIFEST.in, would go unbuilt.
    listed = {path for files in C_EXTENSIONS.values() for path in files}
    on_disk = {
        str(path.relative_to(ROOT))
        for pattern in ("*.c", "*.h")
        for path in (ROOT / "kvcache_offload").rglob(pattern)
        if "build" not in path.parts
    }
    assert on_disk == listed
    manifest = (ROOT / "MANIFEST.in").read_text().split()
    assert listed <= set(manifest)


def test_pure_python_switch_loads_the_sources() -> None:
    code = (
        "import kvcache_offload as k, kvcache_offload.control.manager as m;"
        "print(m.__file__);"
        "assert not any(k.compiled_modules().values());"
        "mgr = k.CPUOffloadingManager(2, 'arc');"
        "out = mgr.prepare_store([b'key-0001', b'key-0002']);"
        "assert out is not None and out.store_spec.block_ids.tolist() == [0, 1]"
    )
    env = {**os.environ, PURE_PYTHON_ENV: "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("manager.py")


def test_out_of_tree_policies_subclass_the_compiled_base() -> None:
    class Wrapped(CachePolicy):
        """A Python policy over the compiled base (what an out-of-tree policy does)."""

        name = "wrapped-lru"

        def __init__(self, cache_capacity: int) -> None:
            super().__init__(cache_capacity)
            self.inner = LRUCachePolicy(cache_capacity)

        def get(self, key):  # type: ignore[no-untyped-def]
            return self.inner.get(key)

        def insert(self, key, block):  # type: ignore[no-untyped-def]
            self.inner.insert(key, block)

        def remove(self, key):  # type: ignore[no-untyped-def]
            self.inner.remove(key)

        def touch(self, keys):  # type: ignore[no-untyped-def]
            self.inner.touch(keys)

        def evict(self, n, protected):  # type: ignore[no-untyped-def]
            return self.inner.evict(n, protected)

        def clear(self) -> None:
            self.inner.clear()

        def __len__(self) -> int:
            return len(self.inner)

    manager = CPUOffloadingManager(1, Wrapped)
    first = manager.prepare_store([b"key-0001"])
    assert first is not None
    manager.complete_store([b"key-0001"])
    second = manager.prepare_store([b"key-0002"])
    assert second is not None and second.evicted_keys == [b"key-0001"]


def test_the_compiled_manager_and_policies_can_be_subclassed_in_python() -> None:
    from kvcache_offload.control.policies import ARCCachePolicy

    class CountingManager(CPUOffloadingManager):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            self.lookups = 0

        def lookup(self, key, req_context=None):  # type: ignore[no-untyped-def]
            self.lookups += 1
            return super().lookup(key, req_context)

    class NoTouchLRU(LRUCachePolicy):
        def touch(self, keys):  # type: ignore[no-untyped-def]
            pass  # recency follows insertion only

    class NamedARC(ARCCachePolicy):
        name = "named-arc"

    m = CountingManager(2, NoTouchLRU)
    assert m.prepare_store([b"key-0001", b"key-0002"]) is not None
    m.complete_store([b"key-0001", b"key-0002"])
    m.touch([b"key-0001"])  # ignored by the subclass: key 1 stays least recent
    out = m.prepare_store([b"key-0003"])
    assert out is not None and out.evicted_keys == [b"key-0001"]
    assert m.lookup(b"key-0002") is True and m.lookups == 1
    assert CPUOffloadingManager(1, NamedARC).stats().policy == "named-arc"


def test_python_subclasses_retune_the_compiled_policies() -> None:
    # Tunables are class variables: compiled, an override in a Python subclass still counts.
    from kvcache_offload.control.policies import S3FIFOCachePolicy, SLRUCachePolicy

    class HalfSmall(S3FIFOCachePolicy):
        small_ratio = 0.5

    class HalfProtected(SLRUCachePolicy):
        protected_ratio = 0.5

    assert HalfSmall(10).debug_state()["small_target"] == 5.0
    manager = CPUOffloadingManager(4, HalfProtected)
    keys = [f"key-{i:04d}".encode() for i in range(4)]
    manager.prepare_store(keys)
    manager.complete_store(keys)
    manager.touch(keys)  # all four promoted; the protected share is 2, so 2 drop back
    state = manager.policy.debug_state()
    assert (state["protected"], state["probation"]) == (2, 2), state
