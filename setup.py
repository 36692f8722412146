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


_COMPILED = runpy.run_path(str(HERE / "kvcache_offload" / "_compiled.py"))
C_EXTENSIONS: dict[str, tuple[str, ...]] = _COMPILED["C_EXTENSIONS"]
"""The hand-written C extensions (module -> source, then its headers). Each is optional: one
that fails to build is simply missing (its module's Python code is the fallback), unlike
mypyc's, which all need mypyc's shared runtime."""
STANDALONE = tuple(C_EXTENSIONS)

_C_THREADS: dict[str, tuple[list[str], list[str]]] = {
    # The CPU backend's copy queue runs a thread of its own.
    "kvcache_offload.dataplane.copy._hostcopy": (["-pthread"], ["-pthread"]),
}
"""Extra compile and link flags of the C extensions that need them (all build with -O3): an
extension added to the table in ``_compiled.py`` builds without an entry here."""


def _compiled_sources() -> list[str]:
    return [name.replace(".", "/") + ".py" for name in _COMPILED["COMPILED_MODULES"]]


SERVICE = "kvcache_offload_service"
"""The import name of the HTTP service, whose sources stay in the api/ folder: a top-level
package named ``api`` would collide with any other distribution installing one."""


def _packages() -> list[str]:
    library = find_packages(str(HERE), include=["kvcache_offload", "kvcache_offload.*"])
    service = [
        SERVICE + name[len("api") :] for name in find_packages(str(HERE), include=["api", "api.*"])
    ]
    return [*library, "kvcache_offload.data", *service]


def _c_extensions() -> list[Any]:
    from setuptools import Extension

    out = []
    for name, (source, *headers) in C_EXTENSIONS.items():
        compile_args, link_args = _C_THREADS.get(name, ([], []))
        out.append(
            Extension(
                name,
                [source],
                depends=headers,
                extra_compile_args=["-O3", *compile_args],
                extra_link_args=link_args,
            )
        )
    return out


def _ext_modules() -> list[Any]:
    if os.environ.get("KVCACHE_OFFLOAD_COMPILE", "1").strip().lower() in ("0", "false", "no"):
        _warn("KVCACHE_OFFLOAD_COMPILE=0")
        return []
    return [
        *_mypyc_modules(),
        *_c_extensions(),
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
