"""Bounded chaos: uploads, reads, sidecar stores and loads, late and killed writers, resets.

Every block's bytes are a function of its key, so any byte that a read returns for a key
and that belongs to another key is caught. Runs a fixed number of rounds (a few seconds).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import random
from typing import Any

import anyio
import httpx
import numpy as np
import pytest

from kvcache_offload.aio import OffloadEngine
from kvcache_offload.client import OffloadClient
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import OffloadError
from tests._regions import region_name
from tests.integration._server import running_server
from tests.unit._api_app import BLOCK_BYTES, small_config

ROUNDS = 60


def key(i: int) -> OffloadKey:
    return OffloadKey(i.to_bytes(8, "big") + b"\0\0\0\0")


def content(k: OffloadKey) -> bytes:
    seed = hashlib.sha256(k).digest()
    return (seed * (BLOCK_BYTES // len(seed) + 1))[:BLOCK_BYTES]


def _write_into(memory: Any, slot: int, data: bytes) -> None:
    """A sidecar client's plain memory write into its slot (whole or part of the block)."""
    memory.rows[slot, : len(data)] = np.frombuffer(data, dtype=np.uint8)


async def test_no_read_ever_returns_another_keys_bytes() -> None:
    config = small_config(cpu_bytes_to_use=512 * BLOCK_BYTES, lease_grace_s=60)
    rng = random.Random(13)
    wrong: list[str] = []
    ok_reads = 0
    async with OffloadEngine(config) as engine:
        memory = await engine._get_block_memory()

        async def uploader(worker: int) -> None:
            for n in range(ROUNDS):
                if worker == 0 and n % 15 == 7:  # resets while copies and leases are open
                    await engine.reset()
                keys = list({key(rng.randrange(64)) for _ in range(rng.randint(1, 4))})
                with contextlib.suppress(OffloadError):
                    await engine.write_blocks(keys, [content(k) for k in keys])
                await anyio.sleep(0)

        async def reader(worker: int) -> None:
            nonlocal ok_reads
            for _ in range(ROUNDS * 2):
                await anyio.sleep(0.001)  # let the writers run between reads
                k = key(rng.randrange(64))
                try:
                    data = await engine.read_block(k)
                except OffloadError:
                    continue
                ok_reads += 1
                if data != content(k):
                    wrong.append(f"read_block {k.hex()}")

        async def sidecar_writer(worker: int) -> None:
            for n in range(ROUNDS):
                keys = [key(1000 + worker * 10_000 + n * 4 + j) for j in range(2)]
                late = n % 5 == 0  # sleeps past its TTL, then writes anyway
                killed = n % 7 == 0  # writes half a block, never completes
                try:
                    lease = await engine.prepare_store(keys, ttl_s=0.02 if late or killed else 5)
                except OffloadError:
                    continue
                if late:
                    await anyio.sleep(0.05)
                for k, slot in zip(lease.keys_to_store, lease.block_ids, strict=True):
                    data = content(k)[: BLOCK_BYTES // 2] if killed else content(k)
                    await anyio.to_thread.run_sync(_write_into, memory, slot, data)
                if killed:
                    continue
                with contextlib.suppress(OffloadError):
                    await engine.complete_store(lease.lease_id)

        async def sidecar_reader(worker: int) -> None:
            nonlocal ok_reads
            for _ in range(ROUNDS * 2):
                await anyio.sleep(0.001)
                k = key(1000 + rng.randrange(2) * 10_000 + rng.randrange(ROUNDS * 4))
                try:
                    lease = await engine.prepare_load([k], ttl_s=5)
                except OffloadError:
                    continue
                data = await anyio.to_thread.run_sync(memory.read, lease.block_ids[0])
                try:
                    await engine.complete_load(lease.lease_id)
                except OffloadError:
                    continue  # a reset took the lease: the copy is void
                ok_reads += 1
                if data != content(k):
                    wrong.append(f"sidecar load {k.hex()}")

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for w in range(2):
                    tg.start_soon(uploader, w)
                    tg.start_soon(reader, w)
                    tg.start_soon(sidecar_writer, w)
                    tg.start_soon(sidecar_reader, w)
    assert wrong == []
    assert ok_reads > 20  # the readers did read, concurrently with everything else


# -- a service restart, with a subscriber resuming its event feed across it ---------------------


class _Mapping:
    """A sidecar client's mapping of the region ``/v1/region`` described, made once and kept.

    Like a worker process, it keeps writing through this mapping whatever the service does.
    """

    def __init__(self, info: dict[str, Any]) -> None:
        self._info = info
        with open(info["path"], "r+b") as f:
            self._mm = mmap.mmap(f.fileno(), info["total_size_bytes"])

    def write(self, slot: int, data: bytes) -> None:
        start = self._info["data_offset"] + slot * self._info["row_stride"]
        self._mm[start : start + len(data)] = data

    def close(self) -> None:
        self._mm.close()


class _Feed:
    """One SSE subscriber, read raw so the test holds the ids a client resumes with."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str, dict[str, Any]]] = []  # (id, event, data)
        self.ended = anyio.Event()

    async def follow(self, url: str, headers: dict[str, str]) -> None:
        fields: dict[str, str] = {}
        try:
            async with (
                httpx.AsyncClient(base_url=url, timeout=None) as http,
                http.stream("GET", "/v1/events", headers=headers) as response,
            ):
                assert response.status_code == 200, response.status_code
                async for line in response.aiter_lines():
                    if not line:
                        if "data" in fields:
                            data = json.loads(fields["data"])
                            self.items.append((fields["id"], fields["event"], data))
                        fields = {}
                    elif not line.startswith(":"):
                        name, _, value = line.partition(": ")
                        fields[name] = value
        except httpx.TransportError:
            pass  # the service went away mid-stream: what a restart looks like to a client
        finally:
            self.ended.set()

    def seqs(self) -> list[int]:
        return [data["seq"] for _, event, data in self.items if event != "gap"]


def _close_all(mappings: dict[int, _Mapping]) -> None:
    for mapping in mappings.values():
        mapping.close()


async def _last_seq(client: OffloadClient) -> int:
    return int((await client.stats())["last_event_seq"])


async def test_a_restart_mid_traffic_serves_no_wrong_byte_and_the_resumed_feed_says_so() -> None:
    """Uploads, reads and sidecar stores keep running while the service restarts under them.

    A subscriber that was cut off by the restart resumes with its ``Last-Event-ID`` once the
    new run has published more events than that id's number: it must get the ``restarted`` gap,
    then the new run's events in order (an id taken at face value would silently skip them). A
    sidecar writer whose lease and mapping straddle the restart writes anyway: nothing it
    writes may show up in the new run, and its complete is refused.
    """
    env = {"KVCACHE_OFFLOAD_REGION_NAME": region_name("chaos")}  # the same region across runs
    wrong: list[str] = []
    reads = {"ok": 0}
    stored_on_new = {"count": 0}
    now: dict[str, Any] = {"stop": False}  # the run the clients talk to
    rng = random.Random(17)

    async def uploader() -> None:
        while not now["stop"]:
            client, run = now["client"], now["run"]
            keys = list({key(rng.randrange(64)) for _ in range(rng.randint(1, 3))})
            try:
                await client.put_blocks(keys, [content(k) for k in keys])
                stored_on_new["count"] += run == "second"
            except OffloadError:
                pass
            except httpx.TransportError:
                await anyio.sleep(0.05)  # the service is restarting: back off
            await anyio.sleep(0.002)

    async def reader() -> None:
        while not now["stop"]:
            client, run = now["client"], now["run"]
            k = key(rng.randrange(64) if rng.random() < 0.7 else 5000 + rng.randrange(40))
            try:
                data = await client.get_block(k)
            except OffloadError:
                continue
            except httpx.TransportError:
                await anyio.sleep(0.05)  # the service is restarting: back off
                continue
            reads["ok"] += 1
            if data != content(k):
                wrong.append(f"GET {k.hex()} on the {run} run")

    mappings: dict[int, _Mapping] = {}  # one per run, by its client

    async def sidecar_writer() -> None:
        n = 0
        while not now["stop"]:
            client = now["client"]
            n += 1
            keys = [key(5000 + (n * 2 + j) % 40) for j in range(2)]
            try:
                if id(client) not in mappings:
                    mappings[id(client)] = _Mapping(await client.region())
                mapping = mappings[id(client)]
                lease = await client.prepare_store(keys, ttl_s=5)
                for k, slot in zip(lease.keys_to_store, lease.block_ids, strict=True):
                    await anyio.to_thread.run_sync(mapping.write, slot, content(k))
                await client.complete_store(lease.lease_id)
            except OffloadError:
                pass
            except httpx.TransportError:
                await anyio.sleep(0.05)  # the service is restarting: back off
            await anyio.sleep(0.002)

    with contextlib.ExitStack() as servers:
        servers.callback(_close_all, mappings)
        first = await anyio.to_thread.run_sync(servers.enter_context, running_server(env=env))
        async with contextlib.AsyncExitStack() as clients:
            now["client"] = await clients.enter_async_context(OffloadClient(first.url))
            now["run"] = "first"
            first_region = _Mapping(await now["client"].region())
            mappings[id(now["client"])] = first_region
            feed, resumed = _Feed(), _Feed()
            async with anyio.create_task_group() as tg:
                tg.start_soon(feed.follow, first.url, {})
                for worker in (uploader, reader, sidecar_writer, reader):
                    tg.start_soon(worker)
                # A writer whose lease and half-written block straddle the restart.
                straddler = await now["client"].prepare_store([key(9999)], ttl_s=60)
                (straddle_slot,) = straddler.block_ids
                half = content(key(9999))[: BLOCK_BYTES // 2]
                await anyio.to_thread.run_sync(first_region.write, straddle_slot, half)
                with anyio.fail_after(20):
                    while len(feed.items) < 20 or reads["ok"] < 10:
                        await anyio.sleep(0.01)

                # The restart, with every client still running against the stopping service.
                await anyio.to_thread.run_sync(first.stop)
                with anyio.fail_after(10):
                    await feed.ended.wait()
                second = await anyio.to_thread.run_sync(
                    servers.enter_context, running_server(env=env)
                )
                new = await clients.enter_async_context(OffloadClient(second.url))
                now["client"], now["run"] = new, "second"

                # The subscriber resumes once the new run is past the id it holds.
                last_id = feed.items[-1][0]
                with anyio.fail_after(20):
                    while await _last_seq(new) <= int(last_id.rsplit("-", 1)[1]) + 10:
                        await anyio.sleep(0.01)
                tg.start_soon(resumed.follow, second.url, {"Last-Event-ID": last_id})
                with anyio.fail_after(20):
                    while reads["ok"] < 40 or stored_on_new["count"] < 5:
                        await anyio.sleep(0.01)
                now["stop"] = True
                end = await _last_seq(new)
                with anyio.fail_after(20):  # the resumed feed reaches the last event, then ends
                    while not resumed.seqs() or resumed.seqs()[-1] < end:
                        await anyio.sleep(0.01)
                    tg.cancel_scope.cancel()
            # The straddling writer wakes up: it scribbles over its slot and completes.
            poison = bytes([0xEE]) * BLOCK_BYTES
            await anyio.to_thread.run_sync(first_region.write, straddle_slot, poison)
            with pytest.raises(OffloadError):
                await new.complete_store(straddler.lease_id)
            for k in [key(i) for i in range(64)] + [key(5000 + i) for i in range(40)]:
                with contextlib.suppress(OffloadError):
                    if await new.get_block(k) != content(k):
                        wrong.append(f"GET {k.hex()} after the traffic")
            with pytest.raises(OffloadError):
                await new.get_block(key(9999))  # the straddler's block never became ready

    assert wrong == []
    assert reads["ok"] >= 40  # the readers did read, on both runs
    seqs = feed.seqs()
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # the first run's feed: no hole
    (gap_id, gap_event, gap), *rest = resumed.items
    assert gap_event == "gap" and gap.get("restarted") is True, resumed.items[:2]
    assert gap_id.split("-")[0] != last_id.split("-")[0]  # ids of the new run's epoch
    # Events of the new run not kept for replay are counted in the gap; the rest follow in order.
    assert gap["missed"] == gap["next_seq"] - 1
    assert resumed.seqs() == list(range(gap["next_seq"], gap["next_seq"] + len(rest)))
    assert len(rest) > 10
