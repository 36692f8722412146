"""Secondary-tier benchmark: each tier against the bare client / syscalls moving the same bytes.

    python -m bench.tiers [--blocks 64] [--block-mib 2] [--batch 8] [--repeat 3]
                          [--redis-url redis://...] [--dir PATH] [--only redis,lookup,disk,idle]

Every figure is a ratio to a floor measured in the same run, on the same values:

1. Redis tier (``RedisTier``: checksummed frames, one ``MSET`` of two keys per block) against a
   bare ``redis.asyncio`` pipeline of ``SET`` / ``GET`` of the same values, batch for batch. A
   ``redis-server`` (the OS package) is started on a free loopback port unless ``--redis-url``
   names one. Goal: PUT and GET >= 0.8x. PUT is also timed with the put's checksums taken the
   other way than this machine's default (on a hash thread or on the loop), and as the tier
   put before streaming (the batch hashed, then one pipeline of ``MSET``), for a before/after
   in the same run.
2. Lookup of 64 keys, all in Redis only, through ``OffloadEngine.lookup`` against the same
   lookup on an engine without tiers (64 CPU misses) and against a bare ``redis.asyncio``
   pipeline of the same 64 ``EXISTS``, call by call, ``--lookups`` of each per round and
   ``--repeat`` rounds: p50/p99 of each round, the median round reported. Also the tier set's
   own part: ``TierSet.lookup`` against a bare call of the same lookup script (one round trip
   each). Goal: p99 added < 1 ms.
3. Disk tier (``DiskTier``: header, fsync, rename, checksum on read) against plain loops over
   files in the same directory, batch by batch (one worker-thread hop per batch for all).
   Writes: write+fsync, alternating batch by batch. Reads: the floor is the fastest of three
   plain loops that keep the blocks of their batch, as the tier must to return them:
   ``f.read()``, ``readinto`` an uninitialised numpy array, and the same in 256 KiB reads.
   Every path hops to anyio's worker threads as the tier does (asyncio's own pool gives the
   two sides different threads, so different malloc arenas and page reuse, which moved the
   ratio by up to 2x either way here). Each read path reads every batch in a row, reusing the
   memory it freed itself as a reader does in steady state; the order rotates by round. A
   ``f.read()`` loop that drops each block at once is reported too, but it is no
   floor: it reads into the same already-mapped memory every time, while any reader that hands
   blocks on pays for fresh pages. The ratio is the median over the repeats of floor time /
   tier time. Goal: >= 0.8x. The same files are also read through a tier verifying the other
   way (with its check thread if the default here is without, and the reverse), and the CPU
   time of the process per GB read is reported for each path (a check thread's work does not
   show in wall time). The plain ``f.read()`` loop and the tier are also timed from the
   device: the round's files dropped from the page cache first (``POSIX_FADV_DONTNEED`` on
   those files only).
4. CPU-tier lookups (64 keys, all hits) with a disk tier configured but idle, against the same
   engine without tiers. Goal: no drop.

Prints a table and writes JSON under ``bench/out/``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench._common import write_json
from bench._tiers_disk import bench_disk, bench_idle_tiers
from bench._tiers_redis import RedisServer, bench_lookup, bench_redis
from kvcache_offload import make_offload_key

console = Console(width=150)
SECTIONS = ("redis", "lookup", "disk", "idle")


async def run(args: Any) -> dict[str, Any]:
    size = int(args.block_mib * 1024 * 1024)
    keys = [make_offload_key(f"bench-{i}".encode(), 0) for i in range(args.blocks)]
    values = [os.urandom(size) for _ in range(args.blocks)]
    result: dict[str, Any] = {
        "blocks": args.blocks,
        "block_bytes": size,
        "batch": args.batch,
        "repeat": args.repeat,
        "sections": args.only,
    }
    workdir = Path(tempfile.mkdtemp(prefix="kvo-bench-tiers-", dir=args.dir))
    server = None
    try:
        url = args.redis_url
        if url is None and {"redis", "lookup"} & set(args.only):
            (workdir / "redis").mkdir()
            server = RedisServer(workdir / "redis", maxmemory_mib=4 * args.blocks * 2 + 256)
            url = server.url
        if "redis" in args.only:
            result["redis"] = await bench_redis(url, keys, values, args)
        if "lookup" in args.only:
            result["lookup64"] = await bench_lookup(url, args)
        if "disk" in args.only:
            result["disk"] = await bench_disk(workdir, keys, values, args)
        if "idle" in args.only:
            result["idle_tiers"] = await bench_idle_tiers(workdir, args)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def _rows(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows = []
    if "redis" in result:
        r = result["redis"]
        for op in ("put", "get"):
            spread = ", ".join(f"{x:.2f}" for x in r[op]["round_ratios"])
            rows.append(
                (
                    f"Redis {op.upper()} vs bare redis.asyncio pipeline (rounds: {spread})",
                    f"{r[op]['bare_gbps']:.2f} GB/s",
                    f"{r[op]['tier_gbps']:.2f} GB/s",
                    f"{r[op]['ratio']:.2f}x (>= 0.8)",
                )
            )
            if op == "put":
                way = "on the loop" if r[op]["hash_thread"] else "on a hash thread"
                for key, label in (
                    ("other_way", f"  the same, checksums {way}"),
                    ("pipelined", "  before: the batch hashed, then one MSET pipeline"),
                ):
                    o = r[op][key]
                    spread = ", ".join(f"{x:.2f}" for x in o["round_ratios"])
                    rows.append(
                        (
                            f"{label} (rounds: {spread})",
                            f"{o['bare_gbps']:.2f} GB/s",
                            f"{o['tier_gbps']:.2f} GB/s",
                            f"{o['ratio']:.2f}x",
                        )
                    )
                cpu = r[op]["cpu_s_per_gb"]
                for kind in ("all_threads", "loop_thread"):
                    rows.append(
                        (
                            f"  CPU s per GB put, {kind.replace('_', ' ')}: bare; "
                            "tier / the other way / before",
                            f"{cpu['bare'][kind]:.3f}",
                            " / ".join(
                                f"{cpu[name][kind]:.3f}"
                                for name in ("tier", "other_way", "pipelined")
                            ),
                            "",
                        )
                    )
    if "lookup64" in result:
        lk = result["lookup64"]
        for key, label, goal in (
            ("engine_vs_no_tiers", "lookup 64 keys, all in Redis only, vs no tiers", " (< 1 ms)"),
            ("engine_vs_bare_pipeline", "  the same vs a bare pipeline of 64 EXISTS", ""),
            ("engine_vs_bare_script", "  the same vs a bare call of the tier's script", ""),
            ("tier_set_vs_bare_script", "  TierSet.lookup vs a bare call of its script", ""),
        ):
            x = lk[key]
            rows.append(
                (
                    f"{label}: p50 / p99",
                    f"{x['floor_p50_ms']:.3f} / {x['floor_p99_ms']:.3f} ms",
                    f"{x['path_p50_ms']:.3f} / {x['path_p99_ms']:.3f} ms",
                    f"{x['added_p99_ms']:+.3f} ms p99{goal}",
                )
            )
    if "disk" in result:
        d = result["disk"]
        for op in ("write", "read"):
            floor = "write+fsync" if op == "write" else "read (the fastest of three)"
            rows.append(
                (
                    f"disk {op} vs plain {floor} loop",
                    f"{d[op]['bare_gbps']:.2f} GB/s",
                    f"{d[op]['tier_gbps']:.2f} GB/s",
                    f"{d[op]['ratio']:.2f}x (>= 0.8)",
                )
            )
        rd, cpu = d["read"], d["read"]["cpu_s_per_gb"]
        rows.append(
            (
                "  plain reads: f.read() / readinto an array / the same in 256 KiB reads / "
                "f.read() dropping each block",
                f"{rd['read_gbps']:.2f} / {rd['readinto_gbps']:.2f} / "
                f"{rd['readinto_chunks_gbps']:.2f} / {rd['dropping_gbps']:.2f} GB/s",
                "",
                "",
            )
        )
        rows.append(
            (
                "  the same tier with the check thread "
                + ("off" if rd["check_thread"] else "on")
                + f" (default here: {'on' if rd['check_thread'] else 'off'})",
                f"{d['read']['bare_gbps']:.2f} GB/s",
                f"{rd['tier_other_gbps']:.2f} GB/s",
                f"{rd['other_ratio']:.2f}x",
            )
        )
        rows.append(
            (
                "  CPU s per GB read (all threads): f.read() / readinto; tier / the other way",
                f"{cpu['read']:.3f} / {cpu['readinto']:.3f}",
                f"{cpu['tier']:.3f} / {cpu['tier_other']:.3f}",
                "",
            )
        )
        rows.append(
            (
                "disk read from the device (page cache dropped) vs plain f.read() loop",
                f"{rd['cold_read_gbps']:.2f} GB/s",
                f"{rd['cold_tier_gbps']:.2f} GB/s",
                f"{d['read_from_device']['ratio']:.2f}x",
            )
        )
    if "idle_tiers" in result:
        idle = result["idle_tiers"]
        rows.append(
            (
                "CPU-tier lookups (64 hits), idle disk tier vs none",
                f"{idle['lookups_per_s_no_tiers']:,.0f}/s",
                f"{idle['lookups_per_s_idle_disk']:,.0f}/s",
                f"{idle['ratio']:.2f}x (~1.0)",
            )
        )
    return rows


def show(result: dict[str, Any]) -> None:
    table = Table(
        title=f"secondary tiers: {result['blocks']} x {result['block_bytes'] >> 20} MiB blocks, "
        f"batch {result['batch']}, {result['repeat']} rounds (throughput: best; latency: median "
        "round)"
    )
    for column in ("path", "floor", "tier", "ratio (goal)"):
        table.add_column(column, justify="left" if column == "path" else "right")
    for row in _rows(result):
        table.add_row(*row)
    console.print(table)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.tiers", description=__doc__)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-mib", type=float, default=2.0)
    parser.add_argument("--batch", type=int, default=8, help="blocks per Redis pipeline")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--lookups", type=int, default=1000, help="64-key lookups timed per path and round"
    )
    parser.add_argument("--idle-lookups", type=int, default=20000)
    parser.add_argument("--redis-url", default=None, help="use this server instead of a new one")
    parser.add_argument("--dir", default=None, help="directory for the disk tier (default: /tmp)")
    parser.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help="comma-separated sections to run, in this order: " + ",".join(SECTIONS),
    )
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args(argv)
    args.only = [s for s in SECTIONS if s in args.only.split(",")]
    if args.blocks < 64:
        parser.error("--blocks must be >= 64 (the lookup figure asks for 64 keys)")
    result = asyncio.run(run(args))
    show(result)
    if not args.no_json:
        out = write_json("tiers", result)
        console.print(f"JSON written to {out}")
    return result


if __name__ == "__main__":
    main()
