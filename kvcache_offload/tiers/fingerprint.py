"""The layout fingerprint that namespaces a tier's keys.

Two instances may share blocks only when a block means the same thing to both: the same model
(named by the user, since the service never sees the weights), the same KV dtype, the same
tokens per offloaded block and the same bytes per block. The fingerprint hashes exactly those,
so incompatible instances pointed at one Redis or one directory never see each other's keys.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

__all__ = ["layout_fingerprint"]


def layout_fingerprint(
    *,
    model_id: str,
    kv_dtype: str,
    block_nbytes: int,
    block_tokens: int,
    gpu_block_sizes: Sequence[int],
    world_size: int,
) -> str:
    """16 hex characters naming a block layout (stable across versions and hosts)."""
    described = json.dumps(
        {
            "model_id": model_id,
            "kv_dtype": kv_dtype,
            "block_nbytes": int(block_nbytes),
            "block_tokens": int(block_tokens),
            "gpu_block_sizes": [int(s) for s in gpu_block_sizes],
            "world_size": int(world_size),
        },
        sort_keys=True,
    )
    return hashlib.sha256(described.encode()).hexdigest()[:16]
