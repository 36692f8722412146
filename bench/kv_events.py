"""KV-event throughput and loss: engine events -> ZMQ PUB -> a subscriber process that keeps up.

Three rows, measured in one run against one subscriber process (SUB socket, every batch decoded
with the documented msgspec schema):

* ``raw zmq`` (the floor): pre-encoded batches of the same size sent in a loop on a bare PUB
  socket; the most this transport and this subscriber can take.
* ``hub -> publisher``: engine events published on the engine's event hub, ``--per-tick`` of
  them per event-loop tick, forwarded by the real :class:`KVEventPublisher` task.
* ``engine stores``: sidecar stores (prepare + complete, ``--keys-per-store`` keys) on a
  served-size CPU engine whose tier is full, so every store also evicts: what a busy engine
  emits, through the same publisher.

Throughput is wire events (BlockStored / BlockRemoved) from the first send until the subscriber
received the last one; "lost" counts events that never arrived (no replay is used).

    python -m bench.kv_events [--events 200000] [--engine-events 20000] [--per-tick 64]
                              [--keys-per-store 4] [--encoding array|map]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

import zmq

from bench._common import write_json
from kvcache_offload.aio import OffloadEngine
from kvcache_offload.aio.types import EventType
from kvcache_offload.config import load_config
from kvcache_offload.contracts.offload_key import make_offload_key
from kvcache_offload.kv_events import KVEventPublisher, WireCodec

GOAL_EVENTS_PER_S = 100_000


def _subscriber(endpoint: str, encoding: str, conn: Connection) -> None:
    """Child process: count events per run; report (events, batches, missing seqs, last time)."""
    import msgspec

    from tests.unit._kv_subscriber import schema

    decoder = msgspec.msgpack.Decoder(schema(encoding == "array"))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    conn.send("connected")
    while True:
        # Probe batches until the parent sees us; then one run per (start, end) it sends.
        if sub.poll(20):
            sub.recv_multipart()
            conn.send("live")
            break
    while True:
        order = conn.recv()
        if order is None:
            break
        start, end = order  # batches with start <= seq < end belong to this run
        events = batches = 0
        seen: set[int] = set()
        last = time.time()
        while len(seen) < end - start and sub.poll(2000):
            _, seq_frame, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_frame, "big")
            if not start <= seq < end:
                continue
            events += len(decoder.decode(payload).events)
            batches += 1
            seen.add(seq)
            last = time.time()
        conn.send((events, batches, (end - start) - len(seen), last))
    sub.close(0)
    ctx.term()


class Subscriber:
    def __init__(self, endpoint: str, encoding: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_subscriber, args=(endpoint, encoding, child), daemon=True)
        self.proc.start()
        assert self.conn.recv() == "connected"

    def wait_live(self, probe: Any) -> None:
        while not self.conn.poll(0.02):
            probe()
        assert self.conn.recv() == "live"

    def expect(self, start: int, end: int) -> tuple[int, int, int, float]:
        self.conn.send((start, end))
        result: tuple[int, int, int, float] = self.conn.recv()
        return result

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(10)


def _row(
    name: str, sent: int, got: tuple[int, int, int, float], t0: float, cpu_s: float
) -> dict[str, Any]:
    events, batches, missing, last = got
    seconds = max(last - t0, 1e-9)
    return {
        "cpu_us_per_event": cpu_s * 1e6 / max(sent, 1),
        "path": name,
        "events_sent": sent,
        "events_received": events,
        "events_lost": sent - events,
        "batches": batches,
        "batches_missing": missing,
        "seconds": seconds,
        "events_per_s": events / seconds,
    }


async def _raw_floor(
    pub_sock: zmq.Socket[bytes], codec: WireCodec, args: Any, sub: Subscriber, next_seq: int
) -> tuple[dict[str, Any], int]:
    """Pre-encoded batches of ``per_tick`` events on a bare PUB socket."""
    payloads = [
        codec.encode_batch(
            [
                codec.stored(
                    [i * args.per_tick + j],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=16,
                    medium="CPU",
                    group_idx=0,
                )
                for j in range(args.per_tick)
            ]
        )
        for i in range(max(1, args.events // args.per_tick))
    ]
    start = next_seq
    t0, c0 = time.time(), time.process_time()
    for payload in payloads:
        pub_sock.send_multipart((b"", next_seq.to_bytes(8, "big"), payload))
        next_seq += 1
    cpu = time.process_time() - c0
    got = sub.expect(start, next_seq)
    return _row("raw zmq (floor)", len(payloads) * args.per_tick, got, t0, cpu), next_seq


async def _through_hub(engine: OffloadEngine, args: Any, sub: Subscriber) -> dict[str, Any]:
    pub = engine.kv_events
    assert pub is not None
    hub = engine.event_hub
    await asyncio.sleep(0.05)
    start, sent0 = pub.next_seq, pub.stats().events_published
    keys = [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(args.events)]
    t0, c0 = time.time(), time.process_time()
    for i in range(0, len(keys), args.per_tick):
        for k in keys[i : i + args.per_tick]:
            hub.publish(EventType.STORED, [k])
        await asyncio.sleep(0)  # one loop tick: the publisher batches what was published
    while pub.stats().events_published - sent0 < len(keys):
        await asyncio.sleep(0)
    cpu = time.process_time() - c0
    got = sub.expect(start, pub.next_seq)
    return _row("hub -> publisher", len(keys), got, t0, cpu)


async def _through_engine(engine: OffloadEngine, args: Any, sub: Subscriber) -> dict[str, Any]:
    pub = engine.kv_events
    assert pub is not None
    capacity = engine.stats().capacity_blocks
    n = args.keys_per_store
    counter = 0

    async def store_once() -> None:
        nonlocal counter
        keys = [make_offload_key((counter + j).to_bytes(32, "big"), 0) for j in range(n)]
        counter += n
        lease = await engine.prepare_store(keys)
        await engine.complete_store(lease.lease_id)

    while counter < capacity:  # fill the tier: from here on every store evicts
        await store_once()
    await asyncio.sleep(0.05)
    start, sent0 = pub.next_seq, pub.stats().events_published
    stores = max(1, args.engine_events // 2)  # each store evicts: BlockRemoved + BlockStored
    t0, c0 = time.time(), time.process_time()
    for i in range(stores):
        await store_once()
        if i % 8 == 7:
            await asyncio.sleep(0)
    await asyncio.sleep(0)
    cpu = time.process_time() - c0
    sent = pub.stats().events_published - sent0
    got = sub.expect(start, pub.next_seq)
    return _row(f"engine stores ({n} keys, evicting)", sent, got, t0, cpu)


async def main_async(args: Any) -> list[dict[str, Any]]:
    config = load_config(
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_encoding=args.encoding,
        cpu_bytes_to_use=4096 * 4096,
        layout={"bytes_per_block": 4096},
        backend="cpu",
        event_buffer_size=10_000,
    )
    rows: list[dict[str, Any]] = []
    async with OffloadEngine(config) as engine:
        pub = engine.kv_events
        assert pub is not None
        sub = Subscriber(pub.endpoint, args.encoding)
        try:
            sub.wait_live(lambda: pub.send_batch([pub.codec.cleared()]))
            # The floor shares the socket's sequence space through the publisher's own counter.
            raw_row, _ = await _raw_floor_via(pub, args, sub)
            rows.append(raw_row)
            rows.append(await _through_hub(engine, args, sub))
            rows.append(await _through_engine(engine, args, sub))
        finally:
            sub.close()
    floor = rows[0]["events_per_s"]
    for row in rows:
        row["ratio_to_floor"] = row["events_per_s"] / floor if floor else None
    return rows


async def _raw_floor_via(
    pub: KVEventPublisher, args: Any, sub: Subscriber
) -> tuple[dict[str, Any], int]:
    """The floor on the publisher's own socket, bypassing the hub, translation and encoding."""
    sock = pub._pub  # the bare PUB socket: the transport every row shares
    assert sock is not None
    start = pub.next_seq
    row, end = await _raw_floor(sock, pub.codec, args, sub, start)
    pub._next_seq = end  # keep the socket's sequence numbers contiguous for the next rows
    return row, end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--engine-events", type=int, default=20_000)
    parser.add_argument("--per-tick", type=int, default=64)
    parser.add_argument("--keys-per-store", type=int, default=4)
    parser.add_argument("--encoding", choices=["array", "map"], default="array")
    args = parser.parse_args()
    rows = asyncio.run(main_async(args))
    print(
        f"{'path':<34} {'events':>8} {'lost':>5} {'batches':>8} {'events/s':>10} {'x floor':>8}"
        f" {'cpu us/ev':>9}"
    )
    for r in rows:
        print(
            f"{r['path']:<34} {r['events_received']:>8} {r['events_lost']:>5} {r['batches']:>8}"
            f" {r['events_per_s']:>10,.0f} {r['ratio_to_floor']:>8.2f}"
            f" {r['cpu_us_per_event']:>9.2f}"
        )
    hub = rows[1]
    verdict = hub["events_per_s"] >= GOAL_EVENTS_PER_S and hub["events_lost"] == 0
    print(
        f"goal >= {GOAL_EVENTS_PER_S:,} events/s with 0 lost (hub -> publisher): "
        f"{'met' if verdict else 'NOT met'}"
    )
    path = write_json(
        "kv_events",
        {
            "args": vars(args),
            "goal_events_per_s": GOAL_EVENTS_PER_S,
            "goal_met": verdict,
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
