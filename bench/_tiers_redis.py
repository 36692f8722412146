"""bench.tiers, Redis part: the tier's PUT/GET and the 64-key lookup against bare redis.asyncio.

Every figure pairs the tier with the bare client doing the same thing in the same run,
interleaved, so both see the same server and the same machine weather.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio

from kvcache_offload import KVCacheLayout, OffloadConfig, make_offload_key
from kvcache_offload.aio import OffloadEngine
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.tiers import RedisTier, TierSet
from kvcache_offload.tiers.redis_tier import _encode_headers, redis_block_names


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A throwaway redis-server from the OS package (no persistence, allkeys-lru)."""

    def __init__(self, workdir: Path, maxmemory_mib: int) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server not found: install the redis-server package")
        self.port = _free_port()
        options = {
            "port": str(self.port),
            "bind": "127.0.0.1",
            "save": "",
            "appendonly": "no",
            "dir": str(workdir),
            "maxmemory": f"{maxmemory_mib}mb",
            "maxmemory-policy": "allkeys-lru",
        }
        argv = [binary, *(part for k, v in options.items() for part in (f"--{k}", v))]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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


async def timed(fn: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await fn()
    return time.perf_counter() - start


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


async def bench_redis(url: str, keys: list[OffloadKey], values: list[bytes], args: Any) -> dict:
    """PUT and GET through the tier against a bare pipeline of SET / GET, batch for batch.

    Each round times all batches of every path, the order rotating by round; the ratio is best
    bare round / best tier round, and each round's own ratio is kept to show the spread. PUT is
    also timed through a tier with the other ``hash_thread`` than this machine's default (a
    streamed put's checksums on a thread of the tier, on from four CPUs, or on the loop), and
    the way the tier put before streaming, for a before/after in one run: the batch's headers
    hashed in one worker-thread hop, then one pipeline of ``MSET`` (still the cluster path).
    """
    import redis.asyncio as aioredis

    bare = aioredis.Redis.from_url(url)
    tier = RedisTier(url, "bench" + "0" * 11)
    other = RedisTier(url, "bench" + "0" * 11, hash_thread=not tier.hash_thread)
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

    async def tier_put(through: RedisTier = tier) -> None:
        for ks, vals in batches:
            await through.put(list(zip(ks, vals, strict=True)))

    async def pipelined_put() -> None:
        for ks, vals in batches:
            items = list(zip(ks, vals, strict=True))
            headers = await anyio.to_thread.run_sync(_encode_headers, items)
            pipe = bare.pipeline(transaction=False)
            for (k, v), h in zip(items, headers, strict=True):
                name = b"pipelined:{" + k.hex().encode() + b"}"
                pipe.execute_command("MSET", name, v, name + b":h", h)
            await pipe.execute()

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
        await tier_put(other)
        await pipelined_put()
        paths: dict[str, list[Callable[[], Awaitable[object]]]] = {
            "put": [bare_put, tier_put, partial(tier_put, other), pipelined_put],
            "get": [bare_get, tier_get],
        }
        for op, fns in paths.items():
            times: list[list[float]] = [[] for _ in fns]
            # CPU seconds of the whole process and of the loop's thread (this one) per round:
            # with a hash thread on a spare core, the loop's share is what bounds the wall time.
            cpu: list[list[tuple[float, float]]] = [[] for _ in fns]
            for i in range(args.repeat):
                order = list(range(len(fns)))
                order = order[i % len(fns) :] + order[: i % len(fns)]
                for j in order:
                    process, thread = time.process_time(), time.thread_time()
                    times[j].append(await timed(fns[j]))
                    cpu[j].append((time.process_time() - process, time.thread_time() - thread))
            out[op] = _throughput(total, times[0], times[1])
            if op == "put":
                out[op]["hash_thread"] = tier.hash_thread
                out[op]["other_way"] = _throughput(total, times[0], times[2])
                out[op]["pipelined"] = _throughput(total, times[0], times[3])
                out[op]["cpu_s_per_gb"] = {
                    name: {
                        "all_threads": median([c[0] for c in cpu[j]]) / (total / 1e9),
                        "loop_thread": median([c[1] for c in cpu[j]]) / (total / 1e9),
                    }
                    for j, name in enumerate(("bare", "tier", "other_way", "pipelined"))
                }
    finally:
        await tier.aclose()
        await other.aclose()
        await bare.aclose()
    return out


def _throughput(total: int, floor: list[float], path: list[float]) -> dict[str, Any]:
    """Best round of each (GB/s), their ratio, and each round's own ratio."""
    b, t = min(floor), min(path)
    return {
        "bare_gbps": total / b / 1e9,
        "tier_gbps": total / t / 1e9,
        "ratio": b / t,
        "round_ratios": [x / y for x, y in zip(floor, path, strict=True)],
    }


def _latency(lat: dict[str, list[float]], floor: str, path: str, rounds: int) -> dict:
    """p50/p99 of ``floor`` and ``path`` per round and the p99 ``path`` adds: median round."""
    per_round = []
    n = len(lat[floor]) // rounds
    for r in range(rounds):
        f, p = lat[floor][r * n : (r + 1) * n], lat[path][r * n : (r + 1) * n]
        per_round.append(
            {
                "floor_p50_ms": _pct(f, 50) * 1e3,
                "floor_p99_ms": _pct(f, 99) * 1e3,
                "path_p50_ms": _pct(p, 50) * 1e3,
                "path_p99_ms": _pct(p, 99) * 1e3,
                "added_p99_ms": (_pct(p, 99) - _pct(f, 99)) * 1e3,
            }
        )
    out: dict[str, Any] = {k: median([r[k] for r in per_round]) for k in per_round[0]}
    out["added_p99_ms_rounds"] = [r["added_p99_ms"] for r in per_round]
    return out


async def bench_lookup(url: str, args: Any) -> dict:
    """A 64-key lookup with every key in Redis only, through ``OffloadEngine.lookup``.

    Five paths, interleaved call by call, ``--lookups`` calls each per round, ``--repeat``
    rounds: the engine without tiers (64 CPU misses), the engine with the Redis tier (64 hits
    in one round trip), a bare ``redis.asyncio`` pipeline of the same 64 ``EXISTS``, a bare
    call of the tier's lookup script, and ``TierSet.lookup`` alone. Figures: the p99 the
    tiered lookup adds over no tiers (the goal) and over the bare pipeline, and the tier set's
    own part over the bare script call (the same round trip, so what the tier set adds).
    """
    import redis.asyncio as aioredis

    from kvcache_offload.tiers.redis_tier import EXISTS_EACH_SCRIPT

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

    fingerprint = "lookup" + "0" * 10
    tier = RedisTier(url, fingerprint)
    tier_set = TierSet([tier], read_timeout_s=5.0)
    bare = aioredis.Redis.from_url(url)
    names = [redis_block_names(fingerprint, k)[0] for k in ks]
    short = 0

    async def bare_pipeline() -> None:
        pipe = bare.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        assert sum(await pipe.execute()) == len(names)

    async def bare_script() -> None:
        found = await bare.execute_command("EVAL", EXISTS_EACH_SCRIPT, len(names), *names)
        assert found == b"1" * len(names)

    async def set_lookup() -> None:
        assert len(await tier_set.lookup(ks)) == len(ks)

    out: dict[str, Any] = {"keys": len(ks), "lookups_per_round": args.lookups}
    try:
        await tier.put([(k, bytes(block)) for k in ks])
        async with (
            OffloadEngine(config()) as no_tiers,
            OffloadEngine(config(remote_url=url)) as with_redis,
        ):
            assert (await with_redis.lookup(ks)).hits == len(ks)  # also connects
            assert (await no_tiers.lookup(ks)).hits == 0

            async def engine_redis() -> None:
                nonlocal short
                # Past the tier's read deadline (0.5 s) a lookup answers misses, not waits.
                short += (await with_redis.lookup(ks)).hits != len(ks)

            paths = {
                "no_tiers": partial(no_tiers.lookup, ks),
                "bare_pipeline": bare_pipeline,
                "engine_redis": engine_redis,
                "bare_script": bare_script,
                "tier_set": set_lookup,
            }
            for fn in paths.values():
                await fn()
            lat: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(args.repeat * args.lookups):
                for name, fn in paths.items():
                    lat[name].append(await timed(fn))
    finally:
        await tier_set.aclose()
        await bare.aclose()
    rounds = args.repeat
    out["engine_vs_no_tiers"] = _latency(lat, "no_tiers", "engine_redis", rounds)
    out["engine_vs_bare_pipeline"] = _latency(lat, "bare_pipeline", "engine_redis", rounds)
    out["engine_vs_bare_script"] = _latency(lat, "bare_script", "engine_redis", rounds)
    out["tier_set_vs_bare_script"] = _latency(lat, "bare_script", "tier_set", rounds)
    out["answers_short_of_64_hits"] = short
    return out
