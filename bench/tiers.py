"""Secondary-tier benchmark: each tier against the bare client / syscalls moving the same bytes.

    python -m bench.tiers [--blocks 64] [--block-mib 2] [--batch 8] [--repeat 3]
                          [--redis-url redis://...] [--dir PATH]

Every figure is a ratio to a floor measured in the same run, on the same values:

1. Redis tier (``RedisTier``, one pipeline per batch, checksummed frames) against a bare
   ``redis.asyncio`` pipeline of ``SET`` / ``GET`` of the same values, batch for batch. A
   ``redis-server`` (the OS package) is started on a free loopback port unless ``--redis-url``
   names one. Goal: PUT and GET >= 0.8x.
2. Lookup of 64 keys, all in Redis only, through ``OffloadEngine.lookup`` against the same
   lookup on an engine without tiers (64 CPU misses), call by call, ``--lookups`` of each per
   round and ``--repeat`` rounds: p50/p99 of each round, the median round reported. Also the
   tier set's own part: ``TierSet.lookup`` against the same 64 ``EXISTS`` in one bare pipeline
   (one round trip). Goal: p99 added < 1 ms.
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
   tier time. Goal: >= 0.8x. The same two reads are also timed from the device: the round's
   files dropped from the page cache first (``POSIX_FADV_DONTNEED`` on those files only).
4. CPU-tier lookups (64 keys, all hits) with a disk tier configured but idle, against the same
   engine without tiers. Goal: no drop.

Prints a table and writes JSON under ``bench/out/``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import numpy as np
from rich.console import Console
from rich.table import Table

from bench._common import write_json
from kvcache_offload import KVCacheLayout, OffloadConfig, make_offload_key
from kvcache_offload.aio import OffloadEngine
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.tiers import DiskTier, RedisTier, TierSet
from kvcache_offload.tiers.redis_tier import redis_key_prefix

console = Console(width=150)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _RedisServer:
    """A throwaway redis-server from the OS package (no persistence, allkeys-lru)."""

    def __init__(self, workdir: Path, maxmemory_mib: int) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server not found: install the redis-server package")
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
                "--maxmemory",
                f"{maxmemory_mib}mb",
                "--maxmemory-policy",
                "allkeys-lru",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise SystemExit("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


async def _timed(fn: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await fn()
    return time.perf_counter() - start


async def _in_thread(fn: Callable[..., object], *args: object) -> object:
    """The worker-thread hop the tiers use (anyio's pool: the same threads, the same arenas)."""
    return await anyio.to_thread.run_sync(partial(fn, *args))


async def _best(repeat: int, fn: Callable[[], Awaitable[object]]) -> float:
    return min([await _timed(fn) for _ in range(repeat)])


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


async def bench_redis(url: str, keys: list[OffloadKey], values: list[bytes], args: Any) -> dict:
    import redis.asyncio as aioredis

    bare = aioredis.Redis.from_url(url)
    tier = RedisTier(url, "bench" + "0" * 11)
    batches = [
        (keys[i : i + args.batch], values[i : i + args.batch])
        for i in range(0, len(keys), args.batch)
    ]
    names = [b"bare:" + k.hex().encode() for k in keys]
    name_batches = [names[i : i + args.batch] for i in range(0, len(names), args.batch)]

    async def bare_put() -> None:
        for (_, vals), ns in zip(batches, name_batches, strict=True):
            pipe = bare.pipeline(transaction=False)
            for n, v in zip(ns, vals, strict=True):
                pipe.set(n, v)
            await pipe.execute()

    async def tier_put() -> None:
        for ks, vals in batches:
            await tier.put(list(zip(ks, vals, strict=True)))

    async def bare_get() -> None:
        for ns in name_batches:
            pipe = bare.pipeline(transaction=False)
            for n in ns:
                pipe.get(n)
            got = await pipe.execute()
            assert all(g is not None for g in got)

    async def tier_get() -> None:
        for ks, _ in batches:
            got = await tier.get(ks)
            assert all(g is not None for g in got)

    total = sum(len(v) for v in values)
    out: dict[str, Any] = {}
    try:
        # Warm both paths (connections, server allocations), then interleave the repeats.
        await bare_put()
        await tier_put()
        for op, bare_fn, tier_fn in (("put", bare_put, tier_put), ("get", bare_get, tier_get)):
            b_times, t_times = [], []
            for _ in range(args.repeat):
                b_times.append(await _timed(bare_fn))
                t_times.append(await _timed(tier_fn))
            b, t = min(b_times), min(t_times)
            out[op] = {
                "bare_gbps": total / b / 1e9,
                "tier_gbps": total / t / 1e9,
                "ratio": b / t,
            }

    finally:
        await tier.aclose()
        await bare.aclose()
    return out


def _latency_summary(rounds: list[dict[str, list[float]]], floor: str, path: str) -> dict:
    """p50/p99 of both paths per round, and the p99 the path adds, as the median of rounds."""
    per_round = []
    for lat in rounds:
        per_round.append(
            {
                f"{floor}_p50_ms": _pct(lat[floor], 50) * 1e3,
                f"{floor}_p99_ms": _pct(lat[floor], 99) * 1e3,
                f"{path}_p50_ms": _pct(lat[path], 50) * 1e3,
                f"{path}_p99_ms": _pct(lat[path], 99) * 1e3,
                "added_p50_ms": (_pct(lat[path], 50) - _pct(lat[floor], 50)) * 1e3,
                "added_p99_ms": (_pct(lat[path], 99) - _pct(lat[floor], 99)) * 1e3,
            }
        )
    out: dict[str, Any] = {
        k: sorted(r[k] for r in per_round)[len(per_round) // 2] for k in per_round[0]
    }
    out["added_p99_ms_rounds"] = [r["added_p99_ms"] for r in per_round]
    return out


async def _paired_rounds(
    paths: dict[str, Callable[[], Awaitable[object]]], rounds: int, n: int
) -> list[dict[str, list[float]]]:
    """``n`` timed calls of each path per round, interleaved call by call."""
    out = []
    for _ in range(rounds):
        lat: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(n):
            for name, fn in paths.items():
                lat[name].append(await _timed(fn))
        out.append(lat)
    return out


async def bench_lookup(url: str, args: Any) -> dict:
    """A 64-key lookup with every key in Redis only, against the same lookup without tiers.

    Through the public API (``OffloadEngine.lookup``): the answer without tiers is 64 misses
    from the CPU tier; with the Redis tier it is 64 hits found in one pipelined round trip.
    Also the tier's own cost over that round trip: ``TierSet.lookup`` against the same 64
    ``EXISTS`` in one bare pipeline.
    """
    import redis.asyncio as aioredis

    block = 4096
    ks = [make_offload_key(f"lookup-{i}".encode(), 0) for i in range(64)]

    def config(**tiers: Any) -> OffloadConfig:
        return OffloadConfig(
            cpu_bytes_to_use=128 * block,
            layout=KVCacheLayout(bytes_per_block=block),
            backend="cpu",
            model_id="bench-lookup",
            **tiers,
        )

    async with OffloadEngine(config(remote_url=url)) as writer:
        await writer.write_blocks(ks, [bytes(block)] * len(ks))
        deadline = time.monotonic() + 30
        while next(t for t in writer.stats().tiers if t.name == "redis").put_blocks < len(ks):
            if time.monotonic() > deadline:
                raise SystemExit("the 64 blocks did not reach Redis")
            await asyncio.sleep(0.01)

    out: dict[str, Any] = {"keys": len(ks), "lookups_per_round": args.lookups}
    async with (
        OffloadEngine(config()) as no_tiers,
        OffloadEngine(config(remote_url=url)) as with_redis,
    ):
        assert (await with_redis.lookup(ks)).hits == len(ks)  # also connects
        assert (await no_tiers.lookup(ks)).hits == 0
        short = 0

        async def tiered_lookup() -> None:
            nonlocal short
            short += (await with_redis.lookup(ks)).hits != len(ks)

        rounds = await _paired_rounds(
            {"no_tiers": partial(no_tiers.lookup, ks), "redis": tiered_lookup},
            args.repeat,
            args.lookups,
        )
        out["engine"] = _latency_summary(rounds, "no_tiers", "redis")
        # Past the tier's read deadline (0.5 s) a lookup answers misses instead of waiting.
        out["engine"]["answers_short_of_64_hits"] = short

    # The tier set's part, on a tier of its own (same server, its own namespace).
    fingerprint = "lookup" + "0" * 10
    tier = RedisTier(url, fingerprint)
    tier_set = TierSet([tier], read_timeout_s=5.0)
    bare = aioredis.Redis.from_url(url)
    names = [redis_key_prefix(fingerprint) + k.hex().encode() for k in ks]

    async def bare_exists() -> None:
        pipe = bare.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        assert sum(await pipe.execute()) == len(names)

    async def set_lookup() -> None:
        assert len(await tier_set.lookup(ks)) == len(ks)

    try:
        await tier.put([(k, bytes(block)) for k in ks])
        await bare_exists()
        rounds = await _paired_rounds(
            {"bare": bare_exists, "tier_set": set_lookup}, args.repeat, args.lookups
        )
    finally:
        await tier_set.aclose()
        await bare.aclose()
    out["tier_set"] = _latency_summary(rounds, "bare", "tier_set")
    return out


async def bench_disk(root: Path, keys: list[OffloadKey], values: list[bytes], args: Any) -> dict:
    """Batch by batch, alternating floor and tier, so both see the same disk weather."""
    batches = [
        (keys[i : i + args.batch], values[i : i + args.batch])
        for i in range(0, len(keys), args.batch)
    ]

    def plain_write(directory: Path, ks: list[OffloadKey], vals: list[bytes]) -> None:
        for k, v in zip(ks, vals, strict=True):
            fd = os.open(directory / k.hex(), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, v)
                os.fsync(fd)
            finally:
                os.close(fd)

    def plain_read(directory: Path, ks: list[OffloadKey]) -> list[bytes]:
        # Keeps the batch's blocks, as any read that hands them on must (the tier does).
        out = []
        for k in ks:
            with open(directory / k.hex(), "rb") as f:
                out.append(f.read())
        return out

    def plain_readinto(
        directory: Path, ks: list[OffloadKey], chunk: int = 1 << 40
    ) -> list[np.ndarray]:
        # The same into uninitialised arrays (no bytes object to size, grow or shrink), in
        # reads of at most ``chunk`` bytes.
        out = []
        for k in ks:
            with open(directory / k.hex(), "rb", buffering=0) as f:
                block = np.empty(os.fstat(f.fileno()).st_size, np.uint8)
                view, pos = block.data, 0
                while pos < len(view):
                    pos += f.readinto(view[pos : pos + chunk]) or len(view)
                out.append(block)
        return out

    def plain_read_dropping(directory: Path, ks: list[OffloadKey]) -> None:
        # Reported, not a floor: dropping each block at once lets malloc hand the same
        # already-mapped 2 MiB to the next read, so it never pays for fresh pages.
        for k in ks:
            with open(directory / k.hex(), "rb") as f:
                f.read()

    total = sum(len(v) for v in values)
    sums: dict[str, dict[str, list[float]]] = {
        "write": {"bare": [], "tier": []},
        "read": {
            name: []
            for name in (
                "bare",
                "tier",
                "read",
                "readinto",
                "readinto_chunks",
                "dropping",
                "cold_read",
                "cold_tier",
            )
        },
    }
    for i in range(args.repeat):
        plain = root / f"plain-{i}"
        plain.mkdir()
        tier = DiskTier(root / f"tier-{i}", 1 << 40, "bench")
        await tier.open()
        w = {"bare": 0.0, "tier": 0.0}
        r = dict.fromkeys(
            ("read", "readinto", "readinto_chunks", "tier", "dropping", "cold_read", "cold_tier"),
            0.0,
        )
        for ks, vals in batches:
            w["bare"] += await _timed(partial(_in_thread, plain_write, plain, ks, vals))
            w["tier"] += await _timed(partial(tier.put, list(zip(ks, vals, strict=True))))
        # Reads: each path runs all its batches in a row, so it reuses the memory it freed
        # itself (as a reader does in steady state) rather than what another path left; the
        # order of the paths rotates from round to round.
        plain_paths = {
            "read": plain_read,
            "readinto": plain_readinto,
            "readinto_chunks": partial(plain_readinto, chunk=256 << 10),
            "dropping": plain_read_dropping,
        }
        readers = [(name, partial(_in_thread, fn, plain)) for name, fn in plain_paths.items()]
        readers.insert(1, ("tier", tier.get))
        turn = i % len(readers)
        for name, read in readers[turn:] + readers[:turn]:
            for ks, _ in batches:
                r[name] += await _timed(partial(read, ks))
        # From the device: the same two reads with this round's files dropped from the page
        # cache first (POSIX_FADV_DONTNEED on these files only; they are clean after fsync).
        for name, read, directory in (
            ("cold_read", readers[0][1], plain),
            ("cold_tier", tier.get, root / f"tier-{i}"),
        ):
            _drop_from_page_cache(directory)
            for ks, _ in batches:
                r[name] += await _timed(partial(read, ks))
        await tier.aclose()
        for name, seconds in w.items():
            sums["write"][name].append(seconds)
        for name, seconds in r.items():
            sums["read"][name].append(seconds)
        # The floor is the faster plain read of this round.
        sums["read"]["bare"].append(min(r["read"], r["readinto"], r["readinto_chunks"]))
    out: dict[str, Any] = {}
    for op, t in sums.items():
        ratios = sorted(b / x for b, x in zip(t["bare"], t["tier"], strict=True))
        out[op] = {
            "bare_gbps": total / min(t["bare"]) / 1e9,
            "tier_gbps": total / min(t["tier"]) / 1e9,
            "ratio": ratios[len(ratios) // 2],
            "ratios": ratios,
        }
    for name in ("read", "readinto", "readinto_chunks", "dropping", "cold_read", "cold_tier"):
        out["read"][f"{name}_gbps"] = total / min(sums["read"][name]) / 1e9
    cold = sorted(
        b / x for b, x in zip(sums["read"]["cold_read"], sums["read"]["cold_tier"], strict=True)
    )
    out["read_from_device"] = {"ratio": cold[len(cold) // 2], "ratios": cold}
    return out


def _drop_from_page_cache(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


async def bench_idle_tiers(root: Path, args: Any) -> dict:
    """CPU-tier lookup rate with an idle disk tier configured vs none, rounds alternating."""
    block = 4096
    ks = [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(64)]
    data = [bytes(block)] * 64

    def config(**tiers: Any) -> OffloadConfig:
        return OffloadConfig(
            cpu_bytes_to_use=128 * block,
            layout=KVCacheLayout(bytes_per_block=block),
            backend="cpu",
            **tiers,
        )

    async def rate(engine: OffloadEngine) -> float:
        start = time.perf_counter()
        for _ in range(args.idle_lookups):
            result = await engine.lookup(ks)
        assert result.hits == 64
        return args.idle_lookups / (time.perf_counter() - start)

    async with (
        OffloadEngine(config()) as bare,
        OffloadEngine(config(disk_path=root / "idle", disk_bytes=1 << 30)) as tiered,
    ):
        await bare.write_blocks(ks, data)
        await tiered.write_blocks(ks, data)
        without, with_disk = [], []
        for _ in range(2 * args.repeat):
            without.append(await rate(bare))
            with_disk.append(await rate(tiered))
    return {
        "lookups_per_s_no_tiers": max(without),
        "lookups_per_s_idle_disk": max(with_disk),
        "ratio": max(with_disk) / max(without),
    }


async def run(args: Any) -> dict[str, Any]:
    size = int(args.block_mib * 1024 * 1024)
    keys = [make_offload_key(f"bench-{i}".encode(), 0) for i in range(args.blocks)]
    values = [os.urandom(size) for _ in range(args.blocks)]
    result: dict[str, Any] = {
        "blocks": args.blocks,
        "block_bytes": size,
        "batch": args.batch,
        "repeat": args.repeat,
    }
    workdir = Path(tempfile.mkdtemp(prefix="kvo-bench-tiers-", dir=args.dir))
    server = None
    try:
        url = args.redis_url
        if url is None:
            (workdir / "redis").mkdir()
            server = _RedisServer(workdir / "redis", maxmemory_mib=4 * args.blocks * 2 + 256)
            url = server.url
        result["redis"] = await bench_redis(url, keys, values, args)
        result["lookup64"] = await bench_lookup(url, args)
        result["disk"] = await bench_disk(workdir, keys, values, args)
        result["idle_tiers"] = await bench_idle_tiers(workdir, args)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def show(result: dict[str, Any]) -> None:
    table = Table(
        title=f"secondary tiers: {result['blocks']} x {result['block_bytes'] >> 20} MiB blocks, "
        f"batch {result['batch']}, {result['repeat']} rounds (throughput: best; latency: median "
        "round)"
    )
    for column in ("path", "floor", "tier", "ratio (goal)"):
        table.add_column(column, justify="left" if column == "path" else "right")
    r, d = result["redis"], result["disk"]
    for op in ("put", "get"):
        table.add_row(
            f"Redis {op.upper()} vs bare redis.asyncio pipeline",
            f"{r[op]['bare_gbps']:.2f} GB/s",
            f"{r[op]['tier_gbps']:.2f} GB/s",
            f"{r[op]['ratio']:.2f}x (>= 0.8)",
        )
    eng, ts = result["lookup64"]["engine"], result["lookup64"]["tier_set"]
    table.add_row(
        "lookup 64 keys, all in Redis only: p50 / p99 vs the same lookup without tiers",
        f"{eng['no_tiers_p50_ms']:.3f} / {eng['no_tiers_p99_ms']:.3f} ms",
        f"{eng['redis_p50_ms']:.3f} / {eng['redis_p99_ms']:.3f} ms",
        f"+{eng['added_p99_ms']:.3f} ms p99 (< 1 ms)",
    )
    table.add_row(
        "  the tier set's part: TierSet.lookup vs one bare pipeline of 64 EXISTS",
        f"{ts['bare_p50_ms']:.3f} / {ts['bare_p99_ms']:.3f} ms",
        f"{ts['tier_set_p50_ms']:.3f} / {ts['tier_set_p99_ms']:.3f} ms",
        f"{ts['added_p99_ms']:+.3f} ms p99",
    )
    for op in ("write", "read"):
        table.add_row(
            f"disk {op} vs plain {'write+fsync' if op == 'write' else 'read (the faster)'} loop",
            f"{d[op]['bare_gbps']:.2f} GB/s",
            f"{d[op]['tier_gbps']:.2f} GB/s",
            f"{d[op]['ratio']:.2f}x (>= 0.8)",
        )
    table.add_row(
        "  plain reads: f.read() / readinto an array / the same in 256 KiB reads / f.read() "
        "dropping each block",
        f"{d['read']['read_gbps']:.2f} / {d['read']['readinto_gbps']:.2f} / "
        f"{d['read']['readinto_chunks_gbps']:.2f} / {d['read']['dropping_gbps']:.2f} GB/s",
        "",
        "",
    )
    dev = d["read"]
    table.add_row(
        "disk read from the device (page cache dropped) vs plain f.read() loop",
        f"{dev['cold_read_gbps']:.2f} GB/s",
        f"{dev['cold_tier_gbps']:.2f} GB/s",
        f"{d['read_from_device']['ratio']:.2f}x",
    )
    idle = result["idle_tiers"]
    table.add_row(
        "CPU-tier lookups (64 hits), idle disk tier vs none",
        f"{idle['lookups_per_s_no_tiers']:,.0f}/s",
        f"{idle['lookups_per_s_idle_disk']:,.0f}/s",
        f"{idle['ratio']:.2f}x (~1.0)",
    )
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
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args(argv)
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
