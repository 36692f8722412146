"""kvcache-offload: offload LLM KV-cache blocks from GPU memory to CPU memory and back."""

# ruff: noqa: F405  (names below come from the contracts and errors packages' own __all__)

# First: with KVCACHE_OFFLOAD_PURE_PYTHON=1, importing _compiled makes the imports below take
# the Python sources of the compiled modules.
from kvcache_offload._compiled import compiled_modules
from kvcache_offload.config import KVCacheLayout, OffloadConfig, load_config
from kvcache_offload.contracts import *  # noqa: F403  (the names listed in __all__)
from kvcache_offload.control.manager import (
    CPUManagerStats,
    CPUOffloadingManager,
)
from kvcache_offload.control.reuse_filter import FilterReusedOffloadingManager
from kvcache_offload.control.spec_factory import OffloadingSpecFactory
from kvcache_offload.errors import *  # noqa: F403  (the whole error hierarchy)

__version__ = "0.1.0"

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
    "FilterReusedOffloadingManager",
    "GPULoadStoreSpec",
    "InvalidKeyError",
    "KVCacheLayout",
    "LeaseError",
    "LeaseExpiredError",
    "LeaseLimitError",
    "LoadStoreSpec",
    "NoSharedRegionError",
    "OffloadConfig",
    "OffloadError",
    "OffloadKey",
    "OffloadingEvent",
    "OffloadingManager",
    "OffloadingSpec",
    "OffloadingSpecFactory",
    "PrepareStoreOutput",
    "RegionError",
    "ReqContext",
    "TierError",
    "TransferError",
    "UnknownPolicyError",
    "UnknownSpecError",
    "__version__",
    "compiled_modules",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "load_config",
    "make_offload_key",
]
