"""Contracts every layer shares: keys, specs, the manager, handler and spec ABCs.

Plain Python (numpy for block ids), no torch: the control plane, the data plane and the
async core all import from here, and nothing here imports them.
"""

from kvcache_offload.contracts.handler import (
    BatchesJobs,
    NotifiesCompletion,
    OffloadingHandler,
    TransferResult,
    TransferSpec,
    TransferType,
)
from kvcache_offload.contracts.kv_caches import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
)
from kvcache_offload.contracts.load_store_spec import (
    BlockIDsLoadStoreSpec,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    LoadStoreSpec,
)
from kvcache_offload.contracts.manager import (
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
)
from kvcache_offload.contracts.offload_key import (
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
    validate_offload_key,
)
from kvcache_offload.contracts.spec import OffloadingSpec

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
    "TransferResult",
    "TransferSpec",
    "TransferType",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "make_offload_key",
    "validate_offload_key",
]
