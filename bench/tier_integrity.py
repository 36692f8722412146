"""Wrong bytes from the tiers under concurrent mixed traffic: the count must be zero.

32 HTTP clients (by default) drive ``kvcache-offload serve`` with a CPU tier far smaller than
the keys in play, over the disk tier, a real ``redis-server``, or both: PUTs, GETs, lookups,
discards, long PUTs that keep the tier writer busy, and the pattern of a session that ends
while the next one starts (PUT X, discard X,
PUT Y at once, so Y takes X's freed slot while X's tier write is still queued). Every key's
block is a function of the key, so every GET is checked: the key's own bytes, or a miss.

    python -m bench.tier_integrity --seconds 60 --tiers disk
    python -m bench.tier_integrity --seconds 60 --tiers redis
    python -m bench.tier_integrity --seconds 60 --tiers disk,redis

Prints requests, GETs that returned bytes, wrong bytes, misses, tier writes dropped (and
why), as a table, and writes JSON with the machine and the command. Exits 1 on a wrong byte.
The integration test ``tests/integration/test_tier_integrity_http.py`` runs the same driver
for a few seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

__all__ = ["Counts", "block_of", "drive", "redis_for_bench"]

BLOCK = 4096


def block_of(key: bytes, size: int = BLOCK) -> bytes:
    """The one block ``key`` ever holds: its SHA-256, repeated."""
    digest = hashlib.sha256(key).digest()
    return (digest * (size // len(digest) + 1))[:size]


def key_of(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\0\0\0\0"


@dataclass
class Counts:
    requests: int = 0
    puts: int = 0
    gets: int = 0
    get_bytes: int = 0
    """GETs answered with a block (each one checked)."""
    wrong: int = 0
    """GETs answered with bytes that are not the key's."""
    misses: int = 0
    lookups: int = 0
    discards: int = 0
    refused: int = 0
    """PUTs the service refused (409/503/507: no room now), a normal answer under load."""
    errors: int = 0
    """Any other status or a transport error."""
    statuses: dict[str, int] = field(default_factory=dict)
    wrong_keys: list[str] = field(default_factory=list)

    def merge(self, other: Counts) -> None:
        for name, value in asdict(other).items():
            if isinstance(value, int):
                setattr(self, name, getattr(self, name) + value)
        for status, n in other.statuses.items():
            self.statuses[status] = self.statuses.get(status, 0) + n
        self.wrong_keys += other.wrong_keys[:10]


async def _client(
    http: httpx.AsyncClient, seed: int, num_keys: int, stop_at: float, block: int
) -> Counts:
    rng = random.Random(seed)
    counts = Counts()

    def pick(n: int) -> list[bytes]:
        return [key_of(rng.randrange(num_keys)) for _ in range(n)]

    async def put(keys: list[bytes]) -> None:
        keys = list(dict.fromkeys(keys))
        body = b"".join(block_of(k, block) for k in keys)
        r = await http.put("/v1/blocks", params={"keys": [k.hex() for k in keys]}, content=body)
        counts.puts += 1
        note(r.status_code, refusals=(409, 503, 507))

    async def discard(keys: list[bytes]) -> None:
        r = await http.post("/v1/discard", json={"keys": [k.hex() for k in keys]})
        counts.discards += 1
        note(r.status_code)

    def note(status: int, refusals: tuple[int, ...] = ()) -> None:
        counts.requests += 1
        if status >= 300:
            counts.statuses[str(status)] = counts.statuses.get(str(status), 0) + 1
            if status in refusals:
                counts.refused += 1
            else:
                counts.errors += 1

    while time.monotonic() < stop_at:
        op = rng.random()
        try:
            if op < 0.30:
                await put(pick(rng.randint(1, 4)))
            elif op < 0.65:
                (k,) = pick(1)
                r = await http.get(f"/v1/blocks/{k.hex()}")
                counts.requests += 1
                counts.gets += 1
                if r.status_code == 200:
                    counts.get_bytes += 1
                    if r.content != block_of(k, block):
                        counts.wrong += 1
                        counts.wrong_keys.append(k.hex())
                elif r.status_code == 409:
                    counts.misses += 1
                else:
                    note(r.status_code)
            elif op < 0.80:
                r = await http.post("/v1/lookup", json={"keys": [k.hex() for k in pick(8)]})
                counts.lookups += 1
                note(r.status_code)
            elif op < 0.85:
                await discard(pick(rng.randint(1, 4)))
            elif op < 0.90:  # a long prompt: keeps the tier writer busy, so writes queue up
                await put(pick(16))
            else:  # a session ends and the next one stores at once, into the freed slots
                gone, fresh = pick(2), pick(2)
                await put(gone)
                await discard(gone)
                await put(fresh)
        except httpx.TransportError:
            counts.requests += 1
            counts.errors += 1
    return counts


async def drive(
    url: str, *, clients: int = 32, seconds: float = 10.0, num_keys: int = 400, block: int = BLOCK
) -> Counts:
    """Run the mixed traffic against ``url`` and return what every client saw."""
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30.0) as http:
        stop_at = time.monotonic() + seconds
        parts = await asyncio.gather(
            *(_client(http, seed, num_keys, stop_at, block) for seed in range(clients))
        )
    total = Counts()
    for part in parts:
        total.merge(part)
    return total


def tier_drops(stats: dict[str, Any]) -> dict[str, int]:
    """Tier writes the service dropped, from ``/v1/stats``."""
    out = {f"writes_dropped_{t['name']}": int(t["writes_dropped"]) for t in stats["tiers"]}
    out["write_queue_full_blocks"] = int(stats.get("tier_write_queue_full_blocks", 0))
    out.update({f"corrupt_{t['name']}": int(t["corrupt_blocks"]) for t in stats["tiers"]})
    return out


@contextmanager
def redis_for_bench(workdir: Path) -> Iterator[str]:
    """A throwaway ``redis-server`` on a free loopback port (no persistence, LRU, 512 MiB)."""
    from bench._service import free_port

    server = shutil.which("redis-server")
    if server is None:
        raise SystemExit("redis-server is not installed")
    port = free_port()
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
         "no", "--maxmemory", "512mb", "--maxmemory-policy", "allkeys-lru", "--dir",
         str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        from bench._service import wait_listening

        wait_listening(port)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def serve_args(tiers: list[str], workdir: Path, redis_url: str | None) -> list[str]:
    args = ["--cpu-bytes", "256KiB", "--log-level", "warning"]
    if "disk" in tiers:
        args += ["--disk-path", str(workdir / "disk"), "--disk-bytes", "64MiB"]
    if "redis" in tiers:
        args += ["--remote-url", str(redis_url)]
    return args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--keys", type=int, default=400)
    parser.add_argument("--tiers", default="disk", help="disk, redis or disk,redis")
    parser.add_argument("--backpressure", action="store_true", help="tier_write_backpressure")
    parser.add_argument(
        "--source", type=Path, default=None, help="serve another checkout (a baseline)"
    )
    args = parser.parse_args(argv)
    tiers = args.tiers.split(",")
    from bench._common import write_json
    from bench._service import running_service

    env = {"KVCACHE_OFFLOAD_LAYOUT__BYTES_PER_BLOCK": str(BLOCK), "KVCACHE_OFFLOAD_BACKEND": "cpu"}
    with tempfile.TemporaryDirectory(prefix="tier-integrity-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        redis_url = stack.enter_context(redis_for_bench(work)) if "redis" in tiers else None
        flags = serve_args(tiers, work, redis_url)
        if args.backpressure:
            flags.append("--tier-write-backpressure")
        source = {"source": args.source} if args.source is not None else {}
        port, _ = stack.enter_context(running_service(flags, env, **source))
        url = f"http://127.0.0.1:{port}"
        counts = asyncio.run(
            drive(url, clients=args.clients, seconds=args.seconds, num_keys=args.keys)
        )
        drops = tier_drops(httpx.get(f"{url}/v1/stats", timeout=10).json())
    rows = [
        ("tiers", args.tiers),
        ("seconds", args.seconds),
        ("clients", args.clients),
        ("requests", counts.requests),
        ("GETs", counts.gets),
        ("GETs with bytes (checked)", counts.get_bytes),
        ("wrong bytes", counts.wrong),
        ("misses", counts.misses),
        ("PUTs refused (no room)", counts.refused),
        ("other errors", counts.errors),
        *drops.items(),
    ]
    width = max(len(str(name)) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    path = write_json(
        "tier_integrity", {"tiers": list(tiers), "counts": asdict(counts), "drops": drops}
    )
    print(f"wrote {path}")
    return 1 if counts.wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
