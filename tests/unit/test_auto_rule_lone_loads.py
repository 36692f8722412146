"""``auto``'s choice for a lone restore-sized load: the kernel, not the staged path's submit
thread (which took 2.0-2.8x the copy floor at 256 MiB-2 GiB on an H100, through the public API). The
choice is pure arithmetic on the handler's settings, so it is checked without a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvcache_offload.dataplane.copy.staging_config import DEFAULT_STAGING_CONFIG
from kvcache_offload.dataplane.handlers.cuda.handler import SingleDirectionOffloadingHandler
from kvcache_offload.dataplane.handlers.cuda.paths import (
    DEFAULT_STAGED_LONE_MAX_LOAD_BYTES,
    DEFAULT_STAGED_LONE_MIN_LOAD_BYTES,
)

MiB = 1024 * 1024


def _load_handler() -> SingleDirectionOffloadingHandler:
    """A load handler's choosing state, as the default configuration builds it on a host
    with the kernel, the DMA and the staged path."""
    h = object.__new__(SingleDirectionOffloadingHandler)
    h.mechanism = "auto"
    h.dma_ok = h.kernel_ok = True
    h.dma_min_fragment_bytes = 0
    h.hybrid_dma_share = 0.0
    h.gpu_to_cpu = False
    h.staged_auto_min_job_bytes = DEFAULT_STAGED_LONE_MIN_LOAD_BYTES
    h.staged_lone_max_job_bytes = DEFAULT_STAGED_LONE_MAX_LOAD_BYTES
    # One DMA piece per 2 MiB block (block-major CPU cells).
    layout = SimpleNamespace(estimated_pieces=lambda plan, _: plan.num_bytes // (2 * MiB))
    h._staged = SimpleNamespace(config=DEFAULT_STAGING_CONFIG, layout=layout)  # type: ignore[assignment]
    return h


def _plan(nbytes: int) -> SimpleNamespace:
    return SimpleNamespace(num_bytes=nbytes, mean_fragment_bytes=32 * 1024)


@pytest.mark.parametrize("mib", [256, 512, 1024, 2048, 4096])
def test_a_lone_restore_sized_load_takes_the_kernel(mib: int) -> None:
    assert _load_handler().choose_mechanism(_plan(mib * MiB), busy=False) == "kernel"  # type: ignore[arg-type]


@pytest.mark.parametrize("mib", [32, 64, 255])
def test_a_lone_load_below_256_mib_keeps_the_staged_path_on_the_callers_thread(mib: int) -> None:
    assert _load_handler().choose_mechanism(_plan(mib * MiB), busy=False) == "staged"  # type: ignore[arg-type]


def test_a_large_load_queued_behind_copies_keeps_the_staged_path() -> None:
    assert _load_handler().choose_mechanism(_plan(1024 * MiB), busy=True) == "staged"  # type: ignore[arg-type]


def test_zero_turns_the_lone_kernel_rule_off() -> None:
    h = _load_handler()
    h.staged_lone_max_job_bytes = 0
    assert h.choose_mechanism(_plan(1024 * MiB), busy=False) == "staged"  # type: ignore[arg-type]
