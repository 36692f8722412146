"""GPU<->CPU transfer throughput of the offloading handlers against one bulk pinned copy.

Layouts (Llama-3-8B-like: 32 layers, 8 KV heads, head size 128, bf16, 16-token GPU blocks):

* ``per_layer``: per-layer ``(2, blocks, 16, 8, 128)`` tensors: 64 fragments of 32 KiB per
  block, so a 1,024-block job is 65,536 fragments;
* ``cross_layer``: one ``(blocks, 2 MiB)`` tensor: one 2 MiB fragment per block;
* ``tp4_70b``: 70B on 4-way TP (80 layers, 2 KV heads per rank): 160 fragments of 8 KiB.

Each job moves 1,024 random GPU blocks to (or from) 1,024 random CPU slots of the handlers'
default CPU allocation (block-major: one pinned buffer, a slot's pages back to back). For
every mechanism (``kernel``: one Triton UVA launch per job; ``dma``: one
``cudaMemcpyBatchAsync`` per job;
``staged[:chunk MiB:depth[:inline][:yield=us][:nothrottle]]``: device
gather or scatter through a GPU staging ring plus one DMA per CPU block, issued by a submit
thread (pausing ``yield`` us after each chunk) unless ``inline``; ``STORE/LOAD``: a
different mechanism per direction, e.g. ``kernel/staged``; ``auto``: the handler's per-job
choice; ``torch``: the plain-torch fallback) it
reports GB/s GPU->CPU and CPU->GPU (CUDA-event time of each job), both directions at once
(wall time of a store and a load submitted together), the host time of ``transfer_async``,
and the ratio to one bulk pinned copy of the same bytes measured in the same run. A sweep
over fragment sizes measures where the DMA overtakes the kernel, and a kernel-config sweep
picks the block size. Prints a table and writes JSON (``--out``).

    python -m bench.transfer [--quick] [--out bench/out/transfer.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench._common import machine_info
from kvcache_offload.contracts.kv_caches import CanonicalKVCaches
from kvcache_offload.contracts.load_store_spec import CPULoadStoreSpec, GPULoadStoreSpec
from kvcache_offload.dataplane.copy.triton_kernel import KernelConfig
from kvcache_offload.dataplane.handlers.cpu_backend import (
    allocate_cpu_tensors,
    canonical_int8_views,
)
from kvcache_offload.dataplane.handlers.cuda import (
    SingleDirectionOffloadingHandler,
    StagingConfig,
)
from kvcache_offload.dataplane.layouts import (
    cross_layer,
    kv_first_per_layer,
)

GiB = 1024**3
JOB_BLOCKS = 1024


@dataclass
class Layout:
    name: str
    fragment_bytes: int
    build: Callable[[int], tuple[CanonicalKVCaches, list[torch.Tensor]]]


def _random_bf16(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    n = 2
    for d in shape:
        n *= d
    raw = torch.empty(n, dtype=torch.uint8, device="cuda")
    raw.random_(0, 256, generator=gen)
    return raw.view(torch.bfloat16).view(shape)


def _per_layer(layers: int, heads: int) -> Callable[[int], tuple[CanonicalKVCaches, list]]:
    def build(num_blocks: int) -> tuple[CanonicalKVCaches, list[torch.Tensor]]:
        gen = torch.Generator(device="cuda").manual_seed(1)
        tensors = [_random_bf16((2, num_blocks, 16, heads, 128), gen) for _ in range(layers)]
        return kv_first_per_layer(tensors), tensors

    return build


def _cross_layer(num_blocks: int) -> tuple[CanonicalKVCaches, list[torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(2)
    t = _random_bf16((num_blocks, 32, 2, 16, 8, 128), gen)
    return cross_layer(t), [t]


LAYOUTS = {
    "per_layer": Layout("per_layer", 32 * 1024, _per_layer(32, 8)),
    "cross_layer": Layout("cross_layer", 2 * 1024 * 1024, _cross_layer),
    "tp4_70b": Layout("tp4_70b", 8 * 1024, _per_layer(80, 2)),
}


def _events_time(fn: Callable[[], None], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e-3)
    return out


def bulk_copy(nbytes: int, reps: int) -> dict[str, float]:
    """One pinned copy of ``nbytes`` each way, and both at once on two streams."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 256)
    dev2 = torch.empty_like(dev).random_(0, 256)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2.copy_(dev2)
    d2h = _events_time(lambda: host.copy_(dev, non_blocking=True), reps + 1)[1:]
    h2d = _events_time(lambda: dev.copy_(host, non_blocking=True), reps + 1)[1:]
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    both = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(s1):
            host.copy_(dev, non_blocking=True)
        with torch.cuda.stream(s2):
            dev2.copy_(host2, non_blocking=True)
        torch.cuda.synchronize()
        both.append(time.perf_counter() - t0)
    both = both[1:]
    return {
        "d2h_gbps": nbytes / statistics.median(d2h) / 1e9,
        "h2d_gbps": nbytes / statistics.median(h2d) / 1e9,
        "both_gbps": 2 * nbytes / statistics.median(both) / 1e9,
    }


def _jobs(rng: np.random.Generator, num_gpu: int, num_cpu: int, n: int, blocks: int) -> list:
    jobs = []
    for _ in range(n):
        gpu = rng.choice(num_gpu, blocks, replace=False)
        cpu = rng.choice(num_cpu, blocks, replace=False)
        jobs.append((GPULoadStoreSpec(gpu, [blocks], [0]), CPULoadStoreSpec(cpu)))
    return jobs


def _run_one(handler: SingleDirectionOffloadingHandler, job_id: int, spec: tuple) -> tuple:
    t0 = time.perf_counter()
    ok = handler.transfer_async(job_id, spec)
    submit = time.perf_counter() - t0
    if not ok:
        raise RuntimeError(f"job {job_id} refused")
    handler.wait({job_id})
    results = handler.get_finished()
    while not results:
        results = handler.get_finished()
    (res,) = results
    if not res.success:
        raise RuntimeError(f"job {job_id} failed")
    return res, submit


class _Ids:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


def measure_handlers(
    store: SingleDirectionOffloadingHandler,
    load: SingleDirectionOffloadingHandler,
    jobs: list,
    reps: int,
    ids: _Ids,
) -> dict[str, Any]:
    d2h, h2d, sub_store, sub_load, both, both_gpu = [], [], [], [], [], []
    nbytes = 0
    for i in range(reps + 1):  # first round warms up (compilation, pools)
        gpu_spec, cpu_spec = jobs[i % len(jobs)]
        res, sub = _run_one(store, ids(), (gpu_spec, cpu_spec))
        nbytes = res.transfer_size
        if i:
            d2h.append(res.transfer_time)
            sub_store.append(sub)
        res, sub = _run_one(load, ids(), (cpu_spec, gpu_spec))
        if i:
            h2d.append(res.transfer_time)
            sub_load.append(sub)
    for i in range(reps + 1):
        a_gpu, a_cpu = jobs[i % len(jobs)]
        b_gpu, b_cpu = jobs[(i + 1) % len(jobs)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        j1, j2 = ids(), ids()
        store.transfer_async(j1, (a_gpu, a_cpu))
        load.transfer_async(j2, (b_cpu, b_gpu))
        store.wait({j1})
        load.wait({j2})
        dt = time.perf_counter() - t0
        done = store.get_finished() + load.get_finished()
        if i:
            both.append(dt)
            both_gpu.append(max(r.transfer_time or 0.0 for r in done))
    return {
        "job_bytes": nbytes,
        "d2h_gbps": nbytes / statistics.median(d2h) / 1e9,
        "h2d_gbps": nbytes / statistics.median(h2d) / 1e9,
        "both_gbps": 2 * nbytes / statistics.median(both) / 1e9,
        "submit_ms_store": statistics.median(sub_store) * 1e3,
        "submit_ms_load": statistics.median(sub_load) * 1e3,
        "d2h_s": d2h,
        "h2d_s": h2d,
        "both_s": both,
        "both_event_s": both_gpu,
        "both_event_gbps": 2 * nbytes / statistics.median(both_gpu) / 1e9,
    }


def _handlers(
    gpu: list[torch.Tensor], cpu: list[torch.Tensor], kv: CanonicalKVCaches, mech: str, **kw: Any
) -> tuple[SingleDirectionOffloadingHandler, SingleDirectionOffloadingHandler]:
    """``mech`` is a mechanism name,
    ``staged:<chunk MiB>:<depth>[:inline][:yield=<us>][:nothrottle]`` or ``STORE/LOAD`` (one
    mechanism per direction)."""
    if "/" in mech:
        store_mech, load_mech = mech.split("/")
        return _handlers(gpu, cpu, kv, store_mech, **kw)[0], _handlers(gpu, cpu, kv, load_mech)[1]
    if ":" in mech:
        mech, *opts = mech.split(":")
        if mech == "staged":
            flags = opts[2:]
            pause = [float(f[6:]) * 1e-6 for f in flags if f.startswith("yield=")]
            kw["staging"] = StagingConfig(
                chunk_bytes=int(float(opts[0]) * 1024 * 1024),
                depth=int(opts[1]) if len(opts) > 1 else 2,
                submit_thread="inline" not in flags,
                yield_s=pause[0] if pause else StagingConfig.yield_s,
                throttle="nothrottle" not in flags,
            )
    refs = kv.group_data_refs
    return (
        SingleDirectionOffloadingHandler(gpu, cpu, 1, refs, True, mechanism=mech, **kw),  # type: ignore[arg-type]
        SingleDirectionOffloadingHandler(gpu, cpu, 1, refs, False, mechanism=mech, **kw),  # type: ignore[arg-type]
    )


def bench_layout(
    layout: Layout, mechanisms: list[str], reps: int, num_blocks: int, out: dict[str, Any]
) -> None:
    kv, _keep = layout.build(num_blocks)
    gpu = canonical_int8_views(kv)
    cpu = allocate_cpu_tensors(gpu, 1, num_blocks, pin_memory=True)  # the handlers' default
    for c, g in zip(cpu, gpu, strict=True):
        c.copy_(g.cpu())  # random bytes, never zeros
    rng = np.random.default_rng(0)
    jobs = _jobs(rng, num_blocks, num_blocks, 3, JOB_BLOCKS)
    ids = _Ids()
    rows: dict[str, Any] = {}
    job_bytes = JOB_BLOCKS * sum(r.page_size_bytes for r in kv.group_data_refs[0])
    rows["bulk"] = bulk_copy(job_bytes, reps)
    print(f"  [{layout.name}] bulk {rows['bulk']}", flush=True)
    for mech in mechanisms:
        try:
            store, load = _handlers(gpu, cpu, kv, mech)
            r = measure_handlers(store, load, jobs, reps if mech != "torch" else 2, ids)
            r["chosen"] = {"store": store.describe(), "load": load.describe()}
            store.shutdown()
            load.shutdown()
        except Exception as exc:
            traceback.print_exc()
            r = {"error": f"{type(exc).__name__}: {exc}"}
        rows[mech] = r
        if "error" not in r:
            b = rows["bulk"]
            r["ratio_d2h"] = r["d2h_gbps"] / b["d2h_gbps"]
            r["ratio_h2d"] = r["h2d_gbps"] / b["h2d_gbps"]
            r["both_over_bulk_oneway"] = r["both_gbps"] / max(b["d2h_gbps"], b["h2d_gbps"])
        print(f"  [{layout.name}] {mech}: {_short(r)}", flush=True)
    out[layout.name] = {
        "fragment_bytes": layout.fragment_bytes,
        "fragments_per_job": JOB_BLOCKS * len(kv.group_data_refs[0]),
        "job_bytes": job_bytes,
        "results": rows,
    }
    del kv, _keep, gpu, cpu
    torch.cuda.empty_cache()


def _short(r: dict[str, Any]) -> str:
    if "error" in r:
        return r["error"]
    keys = ("d2h_gbps", "h2d_gbps", "both_gbps", "submit_ms_store", "submit_ms_load")
    return " ".join(f"{k}={r[k]:.2f}" for k in keys)


def sweep_fragment_sizes(reps: int, total: int) -> list[dict[str, Any]]:
    """Kernel vs DMA for one tensor of pages of each size: where does the DMA win?"""
    rows = []
    for page in (16384, 65536, 262144, 512 * 1024, 1 << 20, 2 << 20):
        n = max(64, total // page)
        num = 2 * n
        gpu_t = torch.empty((num, page), dtype=torch.int8, device="cuda").random_(-128, 127)
        cpu_t = torch.empty((num, page), dtype=torch.int8, pin_memory=True)
        from kvcache_offload.contracts.kv_caches import (
            CanonicalKVCacheRef,
            CanonicalKVCacheTensor,
        )

        kv = CanonicalKVCaches(
            [CanonicalKVCacheTensor(gpu_t, page)], [[CanonicalKVCacheRef(0, page)]]
        )
        rng = np.random.default_rng(page)
        jobs = _jobs(rng, num, num, 2, n)
        row: dict[str, Any] = {"page": page, "fragments": n}
        for mech in ("kernel", "dma"):
            try:
                store, load = _handlers([gpu_t], [cpu_t], kv, mech)
                r = measure_handlers(store, load, jobs, reps, _Ids())
                row[mech] = {k: r[k] for k in ("d2h_gbps", "h2d_gbps", "both_gbps")}
                row[mech]["submit_ms"] = r["submit_ms_store"]
                store.shutdown()
                load.shutdown()
            except Exception as exc:
                row[mech] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"  [sweep] {row}", flush=True)
        rows.append(row)
        del gpu_t, cpu_t, kv
    torch.cuda.empty_cache()
    return rows


KERNEL_CONFIGS = {
    "per_layer": [
        (16384, 4, 0), (16384, 4, 1), (16384, 4, 2), (16384, 4, 4),
        (8192, 4, 2), (32768, 4, 2), (16384, 8, 2), (8192, 4, 4),
    ],
    "tp4_70b": [(16384, 4, 0), (16384, 4, 2), (8192, 4, 2), (8192, 4, 4)],
}  # fmt: skip


def sweep_kernel_configs(reps: int, num_blocks: int) -> list[dict[str, Any]]:
    """Kernel block size, warps and persistent programs per SM (0 = one per work item)."""
    rows = []
    for name, configs in KERNEL_CONFIGS.items():
        kv, keep = LAYOUTS[name].build(num_blocks)
        gpu = canonical_int8_views(kv)
        cpu = [torch.empty((num_blocks, int(t.shape[1])), dtype=torch.int8, pin_memory=True)
               for t in gpu]  # fmt: skip
        jobs = _jobs(np.random.default_rng(3), num_blocks, num_blocks, 2, JOB_BLOCKS)
        for block, warps, ctas in configs:
            cfg = KernelConfig(block_bytes=block, num_warps=warps, ctas_per_sm=ctas)
            row: dict[str, Any] = {"layout": name, "block": block, "warps": warps, "ctas": ctas}
            try:
                store, load = _handlers(gpu, cpu, kv, "kernel", kernel_config=cfg)
                r = measure_handlers(store, load, jobs, reps, _Ids())
                store.shutdown()
                load.shutdown()
                row.update({k: round(r[k], 2) for k in ("d2h_gbps", "h2d_gbps", "both_gbps")})
                row["submit_ms"] = round(r["submit_ms_store"], 3)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
            print(f"  [kernel-config] {row}", flush=True)
            rows.append(row)
        del kv, keep, gpu, cpu
        torch.cuda.empty_cache()
    return rows


def print_table(results: dict[str, Any]) -> None:
    print()
    hdr = (
        f"{'layout':<12} {'mechanism':<16} {'D2H GB/s':>9} {'H2D GB/s':>9} {'both GB/s':>10} "
        f"{'D2H/bulk':>9} {'H2D/bulk':>9} {'both/bulk1':>10} {'submit ms':>10}"
    )
    print(hdr)
    print("-" * len(hdr))
    for name, lay in results.items():
        bulk = lay["results"]["bulk"]
        print(
            f"{name:<12} {'bulk':<16} {bulk['d2h_gbps']:>9.2f} {bulk['h2d_gbps']:>9.2f} "
            f"{bulk['both_gbps']:>10.2f} {1:>9.2f} {1:>9.2f} "
            f"{bulk['both_gbps'] / max(bulk['d2h_gbps'], bulk['h2d_gbps']):>10.2f} {'':>10}"
        )
        for mech, r in lay["results"].items():
            if mech == "bulk":
                continue
            if "error" in r:
                print(f"{name:<12} {mech:<16} {r['error'][:70]}")
                continue
            sub = max(r["submit_ms_store"], r["submit_ms_load"])
            print(
                f"{name:<12} {mech:<16} {r['d2h_gbps']:>9.2f} {r['h2d_gbps']:>9.2f} "
                f"{r['both_gbps']:>10.2f} {r['ratio_d2h']:>9.2f} {r['ratio_h2d']:>9.2f} "
                f"{r['both_over_bulk_oneway']:>10.2f} {sub:>10.3f}"
            )


def device_info() -> dict[str, Any]:
    from kvcache_offload.dataplane.copy.dma import get_cuda_runtime

    props = torch.cuda.get_device_properties(0)
    rt = get_cuda_runtime()
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
    return {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / GiB, 1),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_runtime": rt.version if rt else None,
        "triton": triton_version,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default="per_layer,cross_layer,tp4_70b")
    p.add_argument(
        "--mechanisms",
        default="kernel,dma,staged,kernel/staged,auto,torch",
    )
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--num-blocks", type=int, default=2048, help="GPU blocks = CPU slots")
    p.add_argument("--quick", action="store_true", help="fewer reps, no sweeps")
    p.add_argument("--no-sweeps", action="store_true")
    p.add_argument("--out", type=Path, default=Path("bench/out/transfer.json"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.transfer needs a CUDA GPU; nothing to do", file=sys.stderr)
        return 0
    reps = 2 if args.quick else args.reps
    payload: dict[str, Any] = {
        "benchmark": "transfer",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["python", "-m", "bench.transfer", *(argv or sys.argv[1:])]),
        "machine": machine_info(),
        "device": device_info(),
        "job_blocks": JOB_BLOCKS,
    }
    print(json.dumps(payload["device"]), flush=True)
    results: dict[str, Any] = {}
    payload["layouts"] = results
    args.out.parent.mkdir(parents=True, exist_ok=True)
    mechanisms = args.mechanisms.split(",")
    for name in args.layouts.split(","):
        print(f"layout {name}", flush=True)
        bench_layout(LAYOUTS[name], mechanisms, reps, args.num_blocks, results)
        args.out.write_text(json.dumps(payload, indent=2))
    if not (args.quick or args.no_sweeps):
        payload["fragment_sweep"] = sweep_fragment_sizes(reps, 512 * 1024 * 1024)
        args.out.write_text(json.dumps(payload, indent=2))
        payload["kernel_configs"] = sweep_kernel_configs(3, args.num_blocks)
        args.out.write_text(json.dumps(payload, indent=2))
    print_table(results)
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
