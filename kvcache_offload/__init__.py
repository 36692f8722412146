"""kvcache-offload: offload LLM KV-cache blocks from GPU memory to CPU memory and back.

Everything an embedding application needs imports from here: ``OffloadEngine``,
``OffloadConfig``, ``KVCacheLayout``, ``load_config``, the offload keys, the errors and the
KV-cache ``layouts``. ``import kvcache_offload`` stays torch-free: the engine, its results
and ``layouts`` (which needs torch) load on first use.
"""

# ruff: noqa: F405  (names below come from the contracts and errors packages' own __all__)

# First: with KVCACHE_OFFLOAD_PURE_PYTHON=1, importing _compiled makes the imports below take
# the Python sources of the compiled modules.
from typing import TYPE_CHECKING

from kvcache_offload._compiled import compiled_modules
from kvcache_offload.config import (
    KVCacheLayout,
    OffloadConfig,
    TransferTuning,
    load_config,
)
from kvcache_offload.contracts import *  # noqa: F403  (the names listed in __all__)
from kvcache_offload.control.manager import (
    CPUManagerStats,
    CPUOffloadingManager,
)
from kvcache_offload.control.reuse_filter import FilterReusedOffloadingManager
from kvcache_offload.control.spec_factory import OffloadingSpecFactory
from kvcache_offload.errors import *  # noqa: F403  (the whole error hierarchy)

if TYPE_CHECKING:  # the names below load lazily at run time (``__getattr__``)
    from kvcache_offload.aio import (
        EngineStats,
        EventType,
        LoadResult,
        LookupResult,
        OffloadEngine,
        StoreResult,
    )
    from kvcache_offload.dataplane import layouts

__version__ = "0.2.0"

_LAZY = {
    "OffloadEngine": "kvcache_offload.aio",
    "EngineStats": "kvcache_offload.aio",
    "EventType": "kvcache_offload.aio",
    "LoadResult": "kvcache_offload.aio",
    "LookupResult": "kvcache_offload.aio",
    "StoreResult": "kvcache_offload.aio",
    "layouts": "kvcache_offload.dataplane.layouts",
}
"""Names loaded on first access (module ``__getattr__``), so importing the package stays
light; ``layouts`` is the module itself."""


def __getattr__(name: str) -> object:
    import importlib

    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'kvcache_offload' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if name == "layouts" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "BlockIDsLoadStoreSpec",
    "BlockStateError",
    "CPULoadStoreSpec",
    "CPUManagerStats",
    "CPUOffloadingManager",
    "CanonicalKVCacheRef",
    "CanonicalKVCacheTensor",
    "CanonicalKVCaches",
    "CapacityError",
    "ConfigError",
    "EngineStats",
    "EventType",
    "FilterReusedOffloadingManager",
    "GPULoadStoreSpec",
    "InvalidKeyError",
    "KVCacheLayout",
    "LeaseError",
    "LeaseExpiredError",
    "LeaseLimitError",
    "LoadResult",
    "LoadStoreSpec",
    "LookupResult",
    "NoSharedRegionError",
    "OffloadConfig",
    "OffloadEngine",
    "OffloadError",
    "OffloadKey",
    "OffloadingEvent",
    "OffloadingManager",
    "OffloadingSpec",
    "OffloadingSpecFactory",
    "PrepareStoreOutput",
    "RegionError",
    "ReqContext",
    "StoreResult",
    "TierError",
    "TransferError",
    "TransferTuning",
    "UnknownPolicyError",
    "UnknownSpecError",
    "__version__",
    "compiled_modules",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "layouts",
    "load_config",
    "make_offload_key",
]
