"""python -m bench.object_tier: the object tier against obstore alone, on one SeaweedFS server.

Both figures pair the engine with a baseline measured in the same run, on the same server:

* **restore**: 64 blocks of 2 MiB held only in the object tier (the CPU tier was reset) are
  brought back to the KV tensors by ``engine.lookup`` + ``engine.load`` (fetch, verify, write
  into CPU slots, copy to the "GPU" tensors of the CPU backend), against obstore alone fetching
  the same 64 objects at the same concurrency (``get_async`` + ``bytes_async``, no check, no
  copy). Rounds alternate; the ratio is of the median rounds. Goal: >= 0.8. The tier's own
  ``get`` of the same objects (fetch and verify, without the engine) is timed alongside.
* **store p99**: 2-block stores (4 MiB) into an engine with the object tier (write-through:
  its background writer uploads every completed store) and into one without, interleaved
  store by store, so both see the same machine while the uploads run. Goal: p99 within 10%.
  Back to back, the stores offer far more than the server takes, so the writer falls behind:
  until the write queue is full, each evicting store copies its victims out on the loop (so a
  queued write is not lost); once it is full, new writes are refused at no cost to the store.
  The table gives the p99 of all stores and of those made while the queue was full. A p99 of
  a few hundred stores on a shared machine moves from run to run by more than the goal's 10%,
  so the figure is the median of ``--store-rounds`` rounds (fresh engines each), with the
  spread of the rounds' ratios.

The server runs on the same machine as the benchmark, so on a small VM its CPU use weighs on
both sides of each figure alike. Prints a table and writes JSON under ``bench/out/``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import obstore
from rich.console import Console
from rich.table import Table

from bench._common import write_json
from bench._seaweedfs import SeaweedServer

console = Console()

LAYERS = 32
"""32 layers of K and V, 16 tokens x 8 heads x 256 bytes each: 2 MiB per block."""


def _kv(num_blocks: int, seed: int) -> tuple[list[Any], Any]:
    import torch

    from kvcache_offload.dataplane import layouts

    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 2, 16, 8, 256)
    tensors = [
        torch.randint(-128, 127, shape, dtype=torch.int8, generator=gen) for _ in range(LAYERS)
    ]
    return tensors, layouts.blocks_first_per_layer(tensors)


def _config(block_bytes: int, cpu_blocks: int, **tiers: Any) -> Any:
    from kvcache_offload import KVCacheLayout, OffloadConfig

    return OffloadConfig(
        cpu_bytes_to_use=cpu_blocks * block_bytes,
        layout=KVCacheLayout(bytes_per_block=block_bytes, num_gpu_blocks=64),
        backend="cpu",
        model_id="bench-object",
        **tiers,
    )


async def _wait_written(engine: Any, n: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while next(t for t in engine.stats().tiers if t.name == "object").put_blocks < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"{n} blocks did not reach the object tier in {timeout:.0f} s")
        await asyncio.sleep(0.05)


async def bench_restore(server: SeaweedServer, args: argparse.Namespace) -> dict[str, Any]:
    from kvcache_offload import make_offload_key
    from kvcache_offload.aio import OffloadEngine

    n = args.blocks
    tensors, kv = _kv(64, seed=1)
    block_bytes = sum(int(t[0].numel()) for t in tensors)
    originals = [t.clone() for t in tensors]
    ks = [make_offload_key(f"restore-{i}".encode(), 0) for i in range(n)]
    ids = list(range(n))
    cfg = _config(
        block_bytes,
        n + 16,
        object_url=server.url("restore"),
        object_endpoint=server.endpoint,
        object_concurrency=args.concurrency,
    )
    store = server.store("restore")
    paths: list[str] = []

    async def bare() -> None:
        gate = asyncio.Semaphore(args.concurrency)

        async def one(path: str) -> int:
            async with gate:
                return len(await (await obstore.get_async(store, path)).bytes_async())

        sizes = await asyncio.gather(*(one(p) for p in paths))
        assert len(sizes) == n

    async with OffloadEngine(cfg, kv_caches=kv) as engine:
        await engine.store(ks, ids)
        await _wait_written(engine, n)
        async for chunk in obstore.list(store):
            paths += [m["path"] for m in chunk if m["path"].endswith(".kvb")]
        assert len(paths) == n, paths

        async def forget() -> None:
            await engine.reset()  # the CPU tier forgets them: they are held only below
            for t in tensors:
                t.zero_()

        from kvcache_offload.tiers import ObjectTier

        fingerprint = paths[0].partition("/")[0]
        tier = ObjectTier(
            server.url("restore"),
            fingerprint,
            endpoint=server.endpoint,
            concurrency=args.concurrency,
        )
        await tier.open()

        async def tier_get() -> None:
            got = await tier.get(ks)
            assert all(g is not None for g in got)

        async def through_engine() -> None:
            found = await engine.lookup(ks)
            assert found.hits == n and found.tiers == ["object"] * n, found
            await engine.load(ks, ids)

        times: dict[str, list[float]] = {"engine": [], "obstore": [], "tier_get": []}
        await bare()  # connections warm for all three
        await tier_get()
        await forget()
        await through_engine()
        for i in range(args.repeat):
            paths3 = (("obstore", bare), ("tier_get", tier_get), ("engine", through_engine))
            for name, fn in paths3 if i % 2 else paths3[::-1]:
                if name == "engine":
                    await forget()
                await asyncio.sleep(0.05)  # the previous round's background work settles
                start = time.perf_counter()
                await fn()
                times[name].append(time.perf_counter() - start)
        await tier.aclose()
        exact = all(bool((t == o).all()) for t, o in zip(tensors, originals, strict=True))
        stats = next(t for t in engine.stats().tiers if t.name == "object")
    moved = n * block_bytes
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "blocks": n,
        "block_bytes": block_bytes,
        "concurrency": args.concurrency,
        "seconds": times,
        "engine_gbps_median": moved / med["engine"] / 1e9,
        "obstore_gbps_median": moved / med["obstore"] / 1e9,
        "engine_gbps_best": moved / min(times["engine"]) / 1e9,
        "obstore_gbps_best": moved / min(times["obstore"]) / 1e9,
        "ratio_median": med["obstore"] / med["engine"],
        "tier_get_gbps_median": moved / med["tier_get"] / 1e9,
        "tier_get_ratio_median": med["obstore"] / med["tier_get"],
        "bytes_exact": exact,
        "corrupt_blocks": stats.corrupt_blocks,
        "errors": stats.errors,
    }


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _store_round(
    server: SeaweedServer, args: argparse.Namespace, prefix: str
) -> dict[str, Any]:
    """One round: a fresh engine with the object tier and one without, stores interleaved."""
    from kvcache_offload import make_offload_key
    from kvcache_offload.aio import OffloadEngine

    tensors_on, kv_on = _kv(64, seed=2)
    _, kv_off = _kv(64, seed=3)
    block_bytes = sum(int(t[0].numel()) for t in tensors_on)
    on_cfg = _config(
        block_bytes,
        32,
        object_url=server.url(prefix),
        object_endpoint=server.endpoint,
        object_concurrency=args.concurrency,
    )
    queue_size = on_cfg.tier_queue_size
    lat: dict[str, list[float]] = {"off": [], "on": [], "on_queue_full": []}
    async with (
        OffloadEngine(on_cfg, kv_caches=kv_on) as on,
        OffloadEngine(_config(block_bytes, 32), kv_caches=kv_off) as off,
    ):
        engines = {"on": on, "off": off}
        for i in range(args.stores + 10):
            order = ("on", "off") if i % 2 else ("off", "on")
            for name in order:
                ks = [make_offload_key(f"{name}-{i}-{j}".encode(), 0) for j in range(2)]
                gpu = [(2 * i) % 64, (2 * i + 1) % 64]
                full = name == "on" and on.stats().tier_write_queue_depth >= queue_size
                start = time.perf_counter()
                await engines[name].store(ks, gpu)
                if i >= 10:  # the first stores warm both engines up
                    lat[name].append(time.perf_counter() - start)
                    if full:
                        lat["on_queue_full"].append(lat[name][-1])
        stats = next(t for t in on.stats().tiers if t.name == "object")
    p99 = {k: _pct(v, 0.99) for k, v in lat.items() if v}
    return {
        "p50_ms": {k: 1000 * _pct(v, 0.5) for k, v in lat.items() if v},
        "p99_ms": {k: 1000 * v for k, v in p99.items()},
        "p99_ratio": p99["on"] / p99["off"],
        "stores_while_queue_full": len(lat["on_queue_full"]),
        "tier_queue_size": queue_size,
        "object_blocks_uploaded": stats.put_blocks,
        "object_blocks_dropped": stats.writes_dropped,
    }


async def bench_store_p99(server: SeaweedServer, args: argparse.Namespace) -> dict[str, Any]:
    rounds = []
    for r in range(args.store_rounds):
        rounds.append(await _store_round(server, args, f"stores-{r}"))
    ratios = [r["p99_ratio"] for r in rounds]
    median_round = sorted(rounds, key=lambda r: r["p99_ratio"])[(len(rounds) - 1) // 2]
    return {
        "stores": args.stores,
        "blocks_per_store": 2,
        "rounds": rounds,
        "p99_ratio_median": statistics.median(ratios),
        "p99_ratio_min": min(ratios),
        "p99_ratio_max": max(ratios),
        "median_round": median_round,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvo-bench-s3-") as tmp:
        server = SeaweedServer(Path(tmp))
        server.start()
        os.environ.update(server.env())
        try:
            out: dict[str, Any] = {}
            if args.only in (None, "restore"):
                out["restore"] = await bench_restore(server, args)
            if args.only in (None, "store"):
                out["store_p99"] = await bench_store_p99(server, args)
            return out
        finally:
            server.stop()


def show(result: dict[str, Any]) -> None:
    r, s = result.get("restore"), result.get("store_p99")
    table = Table(title="object tier on one SeaweedFS S3 server (same run, same server)")
    for column in ("figure", "baseline", "object tier", "ratio (goal)"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    if r is not None:
        table.add_row(
            f"restore {r['blocks']} x {r['block_bytes'] >> 20} MiB, concurrency "
            f"{r['concurrency']} (median round): engine lookup+load vs obstore get",
            f"{r['obstore_gbps_median']:.3f} GB/s",
            f"{r['engine_gbps_median']:.3f} GB/s",
            f"{r['ratio_median']:.2f}x (>= 0.8)",
        )
        table.add_row(
            "  the tier's own get of the same 64 (fetch + verify, no engine)",
            f"{r['obstore_gbps_median']:.3f} GB/s",
            f"{r['tier_get_gbps_median']:.3f} GB/s",
            f"{r['tier_get_ratio_median']:.2f}x",
        )
    if s is not None:
        m = s["median_round"]
        table.add_row(
            f"CPU-tier store p99, {s['stores']} stores of 2 x 2 MiB: object tier off vs on "
            f"(the median of {len(s['rounds'])} rounds; ratios {s['p99_ratio_min']:.2f}-"
            f"{s['p99_ratio_max']:.2f})",
            f"{m['p99_ms']['off']:.2f} ms",
            f"{m['p99_ms']['on']:.2f} ms",
            f"{s['p99_ratio_median']:.2f}x (<= 1.10)",
        )
        if "on_queue_full" in m["p99_ms"]:
            table.add_row(
                f"  the same round, only the {m['stores_while_queue_full']} stores made while "
                "the tier write queue was full",
                f"{m['p99_ms']['off']:.2f} ms",
                f"{m['p99_ms']['on_queue_full']:.2f} ms",
                f"{m['p99_ms']['on_queue_full'] / m['p99_ms']['off']:.2f}x",
            )
    console.print(table)
    if r is not None:
        console.print(f"restore bytes exact: {r['bytes_exact']}")
    if s is not None:
        for i, m in enumerate(s["rounds"]):
            console.print(
                f"store round {i}: p99 off {m['p99_ms']['off']:.2f} ms, on "
                f"{m['p99_ms']['on']:.2f} ms ({m['p99_ratio']:.2f}x); p50 off "
                f"{m['p50_ms']['off']:.2f} ms, on {m['p50_ms']['on']:.2f} ms; blocks uploaded "
                f"{m['object_blocks_uploaded']}, dropped {m['object_blocks_dropped']}"
            )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.object_tier", description=__doc__)
    parser.add_argument("--blocks", type=int, default=64, help="blocks per restore (<= 64)")
    parser.add_argument("--concurrency", type=int, default=16, help="object_concurrency")
    parser.add_argument("--repeat", type=int, default=5, help="restore rounds per path")
    parser.add_argument("--stores", type=int, default=300, help="timed stores per engine and round")
    parser.add_argument(
        "--store-rounds",
        type=int,
        default=3,
        help="store rounds, each with fresh engines; the figure is the median round's ratio",
    )
    parser.add_argument(
        "--only", choices=("restore", "store"), help="run one of the two figures (default both)"
    )
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args(argv)
    if not 1 <= args.blocks <= 64:
        parser.error("--blocks must be 1..64")
    if args.store_rounds < 1:
        parser.error("--store-rounds must be >= 1")
    result = asyncio.run(run(args))
    show(result)
    if not args.no_json:
        console.print(f"JSON written to {write_json('object_tier', result)}")
    return result


if __name__ == "__main__":
    main()
