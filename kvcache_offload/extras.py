"""Optional dependencies: which extra provides each, checked before the work that needs it.

``pip install kvcache-offload`` runs the library, ``replay`` and the CLI's help; the service
needs the ``server`` extra, plots the ``plot`` extra, the secondary tiers the ``tiers`` extra.
:func:`require` raises a one-line :class:`~kvcache_offload.errors.ConfigError` naming the extra
to install, so a command fails before it starts its work, not with a traceback after it.
"""

from __future__ import annotations

import importlib.util

from kvcache_offload.errors import ConfigError

__all__ = ["EXTRAS", "extra_for_module", "missing_extra_message", "require"]

EXTRAS: dict[str, tuple[str, ...]] = {
    "server": ("fastapi", "uvicorn", "sse_starlette", "prometheus_client", "httpx", "orjson"),
    "plot": ("matplotlib",),
    "tiers": ("redis", "xxhash"),
    "torch": ("torch",),
}
"""Extra -> the top-level modules it installs that the code imports."""


def extra_for_module(module: str) -> str | None:
    """The extra that installs ``module`` (a dotted name is reduced to its top level)."""
    top = module.split(".")[0]
    for extra, modules in EXTRAS.items():
        if top in modules:
            return extra
    return None


def missing_extra_message(what: str, extra: str, module: str) -> str:
    return (
        f"{what} needs the '{extra}' extra ({module} is not installed): "
        f"pip install 'kvcache-offload[{extra}]'"
    )


def require(extra: str, what: str) -> None:
    """Raise :class:`ConfigError` in one line if a module of ``extra`` is missing."""
    for module in EXTRAS[extra]:
        if importlib.util.find_spec(module) is None:
            raise ConfigError(missing_extra_message(what, extra, module))
