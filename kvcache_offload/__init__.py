"""kvcache-offload: offload LLM KV-cache blocks from GPU memory to CPU memory and back."""

# First: with KVCACHE_OFFLOAD_PURE_PYTHON=1, importing _compiled makes the imports below take
# the Python sources of the compiled modules.
from kvcache_offload._compiled import compiled_modules
from kvcache_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    OffloadingSpec,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from kvcache_offload.config import KVCacheLayout, OffloadConfig, load_config
from kvcache_offload.cpu.common import CPULoadStoreSpec
from kvcache_offload.cpu.manager import CPUManagerStats, CPUOffloadingManager
from kvcache_offload.errors import (
    BlockStateError,
    CapacityError,
    ConfigError,
    InvalidKeyError,
    LeaseError,
    LeaseLimitError,
    NoSharedRegionError,
    OffloadError,
    RegionError,
    TransferError,
    UnknownPolicyError,
    UnknownSpecError,
)
from kvcache_offload.factory import OffloadingSpecFactory
from kvcache_offload.reuse_manager import FilterReusedOffloadingManager

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
