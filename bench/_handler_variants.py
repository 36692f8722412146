"""``auto`` with one CUDA handler default changed, to compare rule candidates in one run.

``auto+old``: lone loads of 256 MiB and more go to the staged path's submit thread
(``auto`` without its upper bound ``DEFAULT_STAGED_LONE_MAX_LOAD_BYTES``); ``auto+inline``:
staged loads issued on the caller's thread at every size (no submit thread);
``auto+kernel``: lone loads take the Triton kernel at every size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

VARIANTS = {
    # ``auto`` with one handler default changed: candidates for the rule, same run.
    "auto+old": {"staged_lone_max_load_bytes": 0},
    "auto+inline": {"staged_lone_max_load_bytes": 0, "staged_min_job_bytes": 1 << 62},
    "auto+kernel": {"staged_min_job_bytes": 1 << 62, "staged_lone_min_load_bytes": 1 << 62},
}


@contextlib.contextmanager
def handler_variant(mechanism: str) -> Iterator[None]:
    """Build handlers inside this block with ``mechanism``'s changed defaults."""
    changes = VARIANTS.get(mechanism, {})
    if not changes:
        yield
        return
    from kvcache_offload.dataplane.handlers.cuda.pair import CpuGpuOffloadingHandlers

    defaults = CpuGpuOffloadingHandlers.__init__.__kwdefaults__
    saved = dict(defaults)
    defaults.update(changes)
    try:
        yield
    finally:
        defaults.clear()
        defaults.update(saved)
