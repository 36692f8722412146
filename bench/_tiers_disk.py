"""bench.tiers, disk part: the disk tier against plain syscall loops over the same directory.

Every path hops to anyio's worker threads as the tier does (asyncio's own pool gives the two
sides different threads, so different malloc arenas and page reuse, which moved the ratio by
up to 2x either way here). Also: CPU-tier lookups with an idle disk tier configured.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from bench._tiers_redis import median
from bench._tiers_redis import timed as _timed
from kvcache_offload import KVCacheLayout, OffloadConfig, make_offload_key
from kvcache_offload.aio import OffloadEngine
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.tiers import DiskTier


async def _in_thread(fn: Callable[..., object], *args: object) -> object:
    """The worker-thread hop the tiers use (anyio's pool: the same threads, the same arenas)."""
    return await anyio.to_thread.run_sync(partial(fn, *args))


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
                "tier_other",
                "read",
                "readinto",
                "readinto_chunks",
                "dropping",
                "cold_read",
                "cold_tier",
            )
        },
    }
    cpu_s: dict[str, list[float]] = {
        name: []
        for name in ("read", "readinto", "readinto_chunks", "dropping", "tier", "tier_other")
    }
    for i in range(args.repeat):
        plain = root / f"plain-{i}"
        plain.mkdir()
        tier = DiskTier(root / f"tier-{i}", 1 << 40, "bench")
        await tier.open()
        w = {"bare": 0.0, "tier": 0.0}
        r = dict.fromkeys(sums["read"], 0.0)
        del r["bare"]
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
        # The same files again through a tier verifying the other way (check thread or not).
        check_thread = tier.check_thread
        other = not check_thread
        other_tier = DiskTier(root / f"tier-{i}", 1 << 40, "bench", check_thread=other)
        await other_tier.open()
        readers.insert(1, ("tier", tier.get))
        readers.insert(3, ("tier_other", other_tier.get))
        turn = i % len(readers)
        for name, read in readers[turn:] + readers[:turn]:
            cpu = time.process_time()
            for ks, _ in batches:
                r[name] += await _timed(partial(read, ks))
            cpu_s[name].append(time.process_time() - cpu)
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
        await other_tier.aclose()
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
    # CPU seconds (all threads of the process) per GB read: with its check thread the tier
    # verifies on a second thread, so its wall time alone would hide what that costs.
    out["read"]["cpu_s_per_gb"] = {
        name: median(seconds) / (total / 1e9) for name, seconds in cpu_s.items()
    }
    other_ratios = sorted(
        b / x for b, x in zip(sums["read"]["bare"], sums["read"]["tier_other"], strict=True)
    )
    out["read"]["check_thread"] = check_thread  # the tier's default on this machine
    out["read"]["other_ratio"] = other_ratios[len(other_ratios) // 2]
    out["read"]["tier_other_gbps"] = total / min(sums["read"]["tier_other"]) / 1e9
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
