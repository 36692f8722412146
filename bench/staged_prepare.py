"""Host time of the staged path's tables for a serving job: the extension against numpy.

    python -m bench.staged_prepare [--rounds 5] [--number 2000]

``StagedTables.prepare`` of a whole-block job of one group (what a serving engine submits)
writes the kernel's job table and the DMA pieces; where the host-copy extension is built,
one C call (``staged_small_tables``) does it, else a dozen numpy calls
(``_prepare_small_numpy``). Both run here on the host, no GPU: the geometry is Llama-8B's
chunking (64 canonical tensors, 32 blocks per 64 MiB staging chunk) with 4 KiB pages, which
changes nothing in the work per job. Jobs of 1, 4 and 16 blocks, both directions, CPU slots
adjacent (one DMA piece) or scattered (a piece per block). Each round times every case with
both paths, in alternating order, as the best of three ``timeit`` repeats of ``--number``
calls; the table shows the median over rounds per call, and the extension's time as a
fraction of numpy's measured in the same rounds. Writes ``bench/out/staged_prepare-*.json``.
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from typing import Any

import numpy as np
import torch

from bench._common import write_json
from kvcache_offload.contracts.kv_caches import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
)
from kvcache_offload.contracts.load_store_spec import CPULoadStoreSpec, GPULoadStoreSpec
from kvcache_offload.dataplane.copy import staged_tables
from kvcache_offload.dataplane.copy.plan import SideGeometry, refs_arrays
from kvcache_offload.dataplane.copy.plan_builder import build_plan, parse_job
from kvcache_offload.dataplane.copy.staged import StagedCopier, StagedJob, StagingConfig
from kvcache_offload.dataplane.handlers.cpu_backend import allocate_cpu_tensors

TENSORS, PAGE, BLOCKS, CHUNK_BLOCKS = 64, 4096, 64, 32
SIZES = (1, 4, 16)


class _Table:
    """A pinned job table's host side, as ``TableSlot.ensure`` hands it out."""

    def __init__(self) -> None:
        self.host = np.zeros(1 << 14, dtype=np.int64)

    def ensure(self, entries: int, need_device: bool) -> np.ndarray:
        return self.host


def _cases() -> list[tuple[str, StagedCopier, StagedJob]]:
    tensors = [
        CanonicalKVCacheTensor(torch.zeros((BLOCKS, PAGE), dtype=torch.int8), PAGE)
        for _ in range(TENSORS)
    ]
    kv = CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(t, PAGE) for t in range(TENSORS)]])
    gpu = [t.tensor for t in kv.tensors]
    cpu = allocate_cpu_tensors(gpu, 1, BLOCKS)
    refs = [refs_arrays(r) for r in kv.group_data_refs]
    config = StagingConfig(chunk_bytes=CHUNK_BLOCKS * TENSORS * PAGE, depth=2)
    g_geom, c_geom = SideGeometry.from_tensors(gpu, 1), SideGeometry.from_tensors(cpu, 1)
    rng = np.random.default_rng(0)
    cases = []
    for gpu_to_cpu in (True, False):
        copier = StagedCopier(gpu, cpu, 1, refs, gpu_to_cpu, None, config=config)  # type: ignore[arg-type]
        copier._ring_base = np.asarray([1 << 32, 1 << 33], dtype=np.int64)  # no GPU ring
        for n in SIZES:
            for slots in ("adjacent", "scattered"):
                cpu_ids = (
                    np.arange(10, 10 + n) if slots == "adjacent" else rng.permutation(BLOCKS)[:n]
                )
                gpu_spec = GPULoadStoreSpec(rng.permutation(BLOCKS)[:n], [n], [0])
                cpu_spec = CPULoadStoreSpec(cpu_ids.astype(np.int64))
                spec = (gpu_spec, cpu_spec) if gpu_to_cpu else (cpu_spec, gpu_spec)
                src, dst = (g_geom, c_geom) if gpu_to_cpu else (c_geom, g_geom)
                plan = build_plan(*parse_job(spec, gpu_to_cpu), refs, src, dst)
                job = StagedJob(plan, None, None, _Table())  # type: ignore[arg-type]
                name = f"{'store' if gpu_to_cpu else 'load'} {n:>2} blocks, {slots}"
                cases.append((name, copier, job))
    return cases


def _time(copier: StagedCopier, job: StagedJob, number: int) -> float:
    """Seconds per ``prepare`` call: the best of three repeats."""
    return min(timeit.repeat(lambda: copier.prepare(job, 1), number=number, repeat=3)) / number


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--number", type=int, default=2000)
    args = parser.parse_args()
    native = staged_tables._small_tables
    if native is None:
        raise SystemExit("the host-copy extension is not built (python setup.py build_ext)")
    cases = _cases()
    paths = {"numpy": None, "native": native}
    times: dict[str, dict[str, list[float]]] = {name: {p: [] for p in paths} for name, *_ in cases}
    for r in range(args.rounds):
        order = list(paths) if r % 2 == 0 else list(paths)[::-1]
        for name, copier, job in cases:
            for path in order:
                staged_tables._small_tables = paths[path]  # type: ignore[assignment]
                times[name][path].append(_time(copier, job, args.number))
    staged_tables._small_tables = native
    rows: list[dict[str, Any]] = []
    print(f"{'job':<30} {'numpy us':>9} {'native us':>10} {'native/numpy':>13}")
    for name, by_path in times.items():
        numpy_us = statistics.median(by_path["numpy"]) * 1e6
        native_us = statistics.median(by_path["native"]) * 1e6
        ratio = statistics.median(
            n / p for n, p in zip(by_path["native"], by_path["numpy"], strict=True)
        )
        print(f"{name:<30} {numpy_us:>9.1f} {native_us:>10.2f} {ratio:>13.3f}")
        rows.append(
            {
                "job": name,
                "numpy_us": numpy_us,
                "native_us": native_us,
                "native_over_numpy": ratio,
                "rounds_s": by_path,
            }
        )
    out = write_json("staged_prepare", {"rounds": args.rounds, "number": args.number, "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
