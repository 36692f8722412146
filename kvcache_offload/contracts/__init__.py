"""Contracts every layer shares: keys, specs, the manager, handler and spec ABCs.

Plain Python (numpy for block ids), no torch: the control plane, the data plane and the
async core all import from here, and nothing here imports them.
"""

# ruff: noqa: F405
# Each contract module names its public API once, in its own ``__all__``; the package
# re-exports those modules whole (a test keeps ``__all__`` below equal to their union).
from kvcache_offload.contracts.handler import *  # noqa: F403
from kvcache_offload.contracts.kv_caches import *  # noqa: F403
from kvcache_offload.contracts.load_store_spec import *  # noqa: F403
from kvcache_offload.contracts.manager import *  # noqa: F403
from kvcache_offload.contracts.offload_key import *  # noqa: F403
from kvcache_offload.contracts.spec import *  # noqa: F403

__all__ = [
    "BatchesJobs",
    "BlockIDsLoadStoreSpec",
    "CPULoadStoreSpec",
    "CanonicalKVCacheRef",
    "CanonicalKVCacheTensor",
    "CanonicalKVCaches",
    "GPULoadStoreSpec",
    "LoadStoreSpec",
    "NotifiesCompletion",
    "OffloadKey",
    "OffloadingEvent",
    "OffloadingHandler",
    "OffloadingManager",
    "OffloadingSpec",
    "PrepareStoreOutput",
    "ReqContext",
    "SignalsCompletionFd",
    "TransferResult",
    "TransferSpec",
    "TransferType",
    "WatchesOnDemand",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "int64_block_ids",
    "make_offload_key",
    "validate_offload_key",
]
