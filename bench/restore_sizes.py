"""Lone restore-sized loads through ``await engine.load``, per mechanism, against the floor.

A returning conversation's restore is one load of 128-2,048 blocks (256 MiB-4 GiB of a
Llama-3.1-8B-shaped cache). For each layout and ``transfer.mechanism``, an engine stores
the largest job once, then times ``await engine.load`` of the first N blocks (one job at a
time, nothing else in flight: what bench.ttft's path 3 does) and divides by the copy floor
(one bare pinned host->device copy of the same bytes, same run).

    python -m bench.restore_sizes [--mechanisms auto,kernel,staged,dma] [--blocks 128,...]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import torch

from bench._common import write_json
from bench._handler_variants import handler_variant
from bench._ttft_model import copy_floor
from kvcache_offload import make_offload_key
from kvcache_offload.aio import OffloadEngine
from kvcache_offload.config import KVCacheLayout, OffloadConfig
from kvcache_offload.dataplane import layouts

_SHAPE = (16, 8, 128)


def _pages(layout: str, num_blocks: int) -> tuple[list[torch.Tensor], Any]:
    dev = "cuda"
    if layout == "llama8b":  # blocks-first (FlashInfer style): 64 KiB per layer and block
        t = [torch.zeros((num_blocks, 2, *_SHAPE), dtype=torch.bfloat16, device=dev)
             for _ in range(32)]  # fmt: skip
        return t, layouts.blocks_first_per_layer(t)
    t = [torch.zeros((2, num_blocks, *_SHAPE), dtype=torch.bfloat16, device=dev)
         for _ in range(32)]  # fmt: skip
    return t, layouts.kv_first_per_layer(t)


async def _one(layout: str, mechanism: str, sizes: list[int], reps: int) -> list[dict[str, Any]]:
    top = max(sizes)
    tensors, kv = _pages(layout, top + 8)
    block = layouts.block_nbytes(kv)
    extra = {} if mechanism.startswith("auto") else {"transfer": {"mechanism": mechanism}}
    config = OffloadConfig(
        cpu_bytes_to_use=(top + 16) * block,
        layout=KVCacheLayout(gpu_block_sizes=[16], bytes_per_block=block, num_gpu_blocks=top + 8),
        **extra,
    )
    keys = [make_offload_key(i.to_bytes(8, "big") + b"restore!", 0) for i in range(top)]
    rows = []
    with handler_variant(mechanism):
        engine = OffloadEngine(config, kv_caches=kv)
    async with engine:
        await engine.store(keys, list(range(top)))
        for n in sizes:
            times = []
            for i in range(reps + 1):
                torch.cuda.synchronize()
                start = time.perf_counter()
                await engine.load(keys[:n], list(range(n)))
                torch.cuda.synchronize()
                if i:
                    times.append(time.perf_counter() - start)
            times.sort()
            handler = engine.worker.transfer_type_to_handler[("CPU", "GPU")]  # type: ignore[union-attr]
            rows.append({
                "layout": layout, "mechanism": mechanism, "blocks": n, "bytes": n * block,
                "load_ms": times[len(times) // 2] * 1e3, "times_ms": [t * 1e3 for t in times],
                "jobs_by_mechanism": {k: v for k, v in handler.jobs_by_mechanism.items() if v},
            })  # fmt: skip
    del tensors
    torch.cuda.empty_cache()
    return rows


async def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    sizes = [int(s) for s in args.blocks.split(",")]
    rows = []
    for layout in args.layouts.split(","):
        for mechanism in args.mechanisms.split(","):
            rows.extend(await _one(layout, mechanism, sizes, args.reps))
    floors = {}
    for r in rows:
        nbytes = r["bytes"]
        if nbytes not in floors:
            floors[nbytes] = copy_floor(nbytes, torch.device("cuda"), args.reps) * 1e3
        r["floor_ms"] = floors[nbytes]
        r["of_floor"] = r["load_ms"] / floors[nbytes]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layouts", default="llama8b,kv_first")
    p.add_argument("--mechanisms", default="auto,kernel,staged,dma")
    p.add_argument("--blocks", default="128,256,512,1024,2048")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    rows = asyncio.run(_run(args))
    print(f"device: {torch.cuda.get_device_name(0)}")
    print(f"{'layout':<9} {'mechanism':<8} {'blocks':>6} {'MiB':>6} {'load ms':>8} "
          f"{'floor ms':>8} {'x floor':>7}  paths")  # fmt: skip
    for r in rows:
        print(f"{r['layout']:<9} {r['mechanism']:<8} {r['blocks']:>6} {r['bytes'] >> 20:>6} "
              f"{r['load_ms']:>8.2f} {r['floor_ms']:>8.2f} {r['of_floor']:>7.2f}  "
              f"{r['jobs_by_mechanism']}")  # fmt: skip
    print(f"wrote {write_json('restore_sizes', {'rows': rows})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
