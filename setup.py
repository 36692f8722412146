"""Build hook: compile the manager and its eviction policies with mypyc when possible.

Everything else about the package is in ``pyproject.toml``. The compiled modules are listed
in ``kvcache_offload/_compiled.py``. The build falls back to the pure-Python package (same
behaviour, slower manager) when mypyc is missing, when ``KVCACHE_OFFLOAD_COMPILE=0``, or when
the C compiler fails; the warning says which.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from typing import Any

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent


def _warn(message: str) -> None:
    print(f"kvcache-offload: {message}; installing the pure-Python manager", file=sys.stderr)


def _compiled_sources() -> list[str]:
    names = runpy.run_path(str(HERE / "kvcache_offload" / "_compiled.py"))["COMPILED_MODULES"]
    return [name.replace(".", "/") + ".py" for name in names]


HOSTCOPY = "kvcache_offload.dataplane.copy._hostcopy"
NATIVE_DUEL = "kvcache_offload.control.policies._native_duel"
KERNEL_ISSUE = "kvcache_offload.dataplane.copy._kernel_issue"
UNITS_HEADER = "kvcache_offload/dataplane/copy/_units.h"
"""The one-group unit planner both C extensions include."""
STANDALONE = (HOSTCOPY, NATIVE_DUEL, KERNEL_ISSUE)
"""C extensions of their own: each one that fails to build is simply missing (its module's
Python code is the fallback), unlike mypyc's, which all need mypyc's shared runtime."""

SERVICE = "kvcache_offload_service"
"""The import name of the HTTP service, whose sources stay in the api/ folder: a top-level
package named ``api`` would collide with any other distribution installing one."""


def _packages() -> list[str]:
    library = find_packages(str(HERE), include=["kvcache_offload", "kvcache_offload.*"])
    service = [
        SERVICE + name[len("api") :] for name in find_packages(str(HERE), include=["api", "api.*"])
    ]
    return [*library, "kvcache_offload.data", *service]


def _hostcopy_extension() -> Any:
    """The host side of a job in C: the CPU backend's GIL-free copy and copy thread, and the
    planner of one-group jobs (optional: Python and ctypes are the fallback)."""
    from setuptools import Extension

    return Extension(
        HOSTCOPY,
        ["kvcache_offload/dataplane/copy/_hostcopy.c"],
        depends=[UNITS_HEADER],
        extra_compile_args=["-O3", "-pthread"],  # its copy queue runs a thread of its own
        extra_link_args=["-pthread"],
    )


def _native_duel_extension() -> Any:
    """The adaptive LRU's weight miniatures in C (optional: the compiled ``_mini_sim`` code
    is the fallback)."""
    from setuptools import Extension

    return Extension(
        NATIVE_DUEL,
        ["kvcache_offload/control/policies/_native_duel.c"],
        extra_compile_args=["-O3"],
    )


def _kernel_issue_extension() -> Any:
    """A lone kernel copy's CUDA calls in one C call (optional: Python issues them otherwise;
    no CUDA headers needed, the functions come as addresses at run time)."""
    from setuptools import Extension

    return Extension(
        KERNEL_ISSUE,
        ["kvcache_offload/dataplane/copy/_kernel_issue.c"],
        depends=[UNITS_HEADER],
        extra_compile_args=["-O3"],
    )


def _ext_modules() -> list[Any]:
    if os.environ.get("KVCACHE_OFFLOAD_COMPILE", "1").strip().lower() in ("0", "false", "no"):
        _warn("KVCACHE_OFFLOAD_COMPILE=0")
        return []
    return [
        *_mypyc_modules(),
        _hostcopy_extension(),
        _native_duel_extension(),
        _kernel_issue_extension(),
    ]


def _mypyc_modules() -> list[Any]:
    try:
        from mypyc.build import mypycify
    except ImportError:
        _warn("mypyc is not available")
        return []
    cwd = os.getcwd()
    os.chdir(HERE)  # mypycify resolves module names from paths relative to the project root
    try:
        return list(
            mypycify(
                ["--config-file", "mypyc.ini", *_compiled_sources()],
                opt_level="3",
                group_name="kvcache_offload",
            )
        )
    except Exception as exc:  # a type error in a compiled module must not block installs
        _warn(f"mypyc failed ({exc})")
        return []
    finally:
        os.chdir(cwd)


class OptionalBuildExt(build_ext):
    """Installs without the extensions if the C compiler is missing or fails.

    All or nothing for mypyc: its per-module extensions need its shared runtime extension, so
    one failure removes every mypyc extension built here. The host-copy, duel and
    kernel-issue extensions stand alone: if one fails, only it is missing (the CPU backend
    then copies through ctypes; the weight miniatures run the compiled Python; the CUDA
    handlers issue their copies from Python).
    """

    def run(self) -> None:
        self._failed = False
        try:
            super().run()
        except Exception as exc:
            self._failed = True
            _warn(f"building the C extensions failed ({exc})")
        if self._failed:
            for ext in self.extensions:
                if ext.name not in STANDALONE:
                    Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)

    def build_extension(self, ext: Any) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            if ext.name in STANDALONE:
                print(
                    f"kvcache-offload: {ext.name} not built ({exc}); its Python fallback instead",
                    file=sys.stderr,
                )
                return
            self._failed = True
            _warn(f"compiling {ext.name} failed ({exc})")


setup(
    packages=_packages(),
    package_dir={SERVICE: "api"},
    ext_modules=_ext_modules(),
    cmdclass={"build_ext": OptionalBuildExt},
)
