"""HTTP service benchmark: lookup throughput/latency and SSE fan-out, server in its own process.

    python -m bench.http                      # both scenarios
    python -m bench.http --only lookup --duration 10 --connections 32
    python -m bench.http --only sse --subscribers 50 --event-rate 20000

The server is ``create_app`` over a CPU-only engine under uvicorn (uvloop + httptools, one
process, access log off), started as a second process on 127.0.0.1. The load generator is a
raw-socket asyncio client (keep-alive, one request in flight per connection, pre-built
request bytes) so that the client spends as little of the shared CPU as possible.

* lookup: ``POST /v1/lookup`` with 64 hex keys (32 of them ready) from ``--connections``
  connections for ``--duration`` seconds after a warm-up: requests/s and p50/p99/max latency.
* sse: ``--subscribers`` clients on ``GET /v1/events`` while the engine's event hub publishes
  ``--event-rate`` events/s for ``--duration`` s. Lost = published - received per subscriber
  (gap events count their ``missed``; a dropped connection resumes with Last-Event-ID and is
  counted). Lag = receive time - event timestamp of the oldest event in each chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LOOKUP_KEYS = 64
READY_KEYS = 32
BLOCK_BYTES = 4096


def _key(i: int) -> str:
    return (i.to_bytes(32, "big") + b"\0\0\0\0").hex()


# -- server process ---------------------------------------------------------------------------


def serve(port: int) -> None:
    """The server side: an engine, ``READY_KEYS`` stored keys and an event-emitting route."""
    import anyio
    import uvicorn
    from fastapi import FastAPI

    from api import create_app
    from kvcache_offload.aio import EventType, OffloadEngine
    from kvcache_offload.config import load_config
    from kvcache_offload.contracts.offload_key import OffloadKey

    config = load_config(
        cpu_bytes_to_use=4096 * BLOCK_BYTES,
        layout={"bytes_per_block": BLOCK_BYTES},
        backend="cpu",
        event_buffer_size=200_000,
        subscriber_queue_size=100_000,
    )
    engine = OffloadEngine(config)
    app: FastAPI = create_app(engine)
    emitted = {"count": 0, "running": False}

    async def emit(rate: float, seconds: float) -> None:
        key = [OffloadKey(bytes.fromhex(_key(10_000)))]
        tick = 0.002
        start = time.perf_counter()
        emitted["running"] = True
        try:
            while (elapsed := time.perf_counter() - start) < seconds:
                due = int(elapsed * rate) - emitted["count"]
                for _ in range(due):
                    engine.event_hub.publish(EventType.STORED, key)
                emitted["count"] += max(due, 0)
                await anyio.sleep(tick)
        finally:
            emitted["running"] = False

    async def start_emit(rate: float, seconds: float) -> dict[str, Any]:
        emitted["count"] = 0
        first = engine.event_hub.last_seq + 1
        app.state.emit_task = asyncio.get_running_loop().create_task(emit(rate, seconds))
        return {"first_seq": first}

    async def emit_status() -> dict[str, Any]:
        return {**emitted, "last_seq": engine.event_hub.last_seq}

    app.add_api_route("/bench/emit", start_emit, methods=["POST"])
    app.add_api_route("/bench/emit", emit_status, methods=["GET"])

    async def main() -> None:
        async with engine:
            lease = await engine.prepare_store(
                [OffloadKey(bytes.fromhex(_key(i))) for i in range(READY_KEYS)]
            )
            await engine.complete_store(lease.lease_id)
            server = uvicorn.Server(
                uvicorn.Config(
                    app,
                    host="127.0.0.1",
                    port=port,
                    loop="none",
                    http="httptools",
                    log_level="warning",
                    access_log=False,
                    lifespan="off",
                )
            )
            await server.serve()

    import uvloop

    uvloop.run(main())


# -- client side ------------------------------------------------------------------------------


class _Server:
    def __init__(self) -> None:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.http", "--serve", str(self.port)], cwd=ROOT
        )

    async def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                status, _ = await _request(self.port, b"GET /readyz HTTP/1.1\r\nHost: b\r\n\r\n")
                if status == 200:
                    return
            except OSError:
                pass
            await asyncio.sleep(0.05)
        raise TimeoutError("bench server did not become ready")

    def cpu_seconds(self) -> float:
        """User + system CPU the server process used so far (Linux /proc)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    match = re.search(rb"(?i)content-length: *(\d+)", head)
    body = await reader.readexactly(int(match.group(1))) if match else b""
    return status, body


async def _request(port: int, raw: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        return await _read_response(reader)
    finally:
        writer.close()


def _post(path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


async def bench_lookup(server: _Server, connections: int, duration: float, warmup: float) -> dict:
    port = server.port
    body = json.dumps({"keys": [_key(i) for i in range(LOOKUP_KEYS)]}).encode()
    raw = _post("/v1/lookup", body)
    latencies: list[float] = []
    errors = 0
    measuring = False
    stop = False

    async def worker() -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        perf = time.perf_counter
        try:
            while not stop:
                t0 = perf()
                writer.write(raw)
                status, _ = await _read_response(reader)
                if measuring:
                    latencies.append(perf() - t0)
                    if status != 200:
                        errors += 1
        finally:
            writer.close()

    tasks = [asyncio.create_task(worker()) for _ in range(connections)]
    await asyncio.sleep(warmup)
    measuring = True
    cpu0, t0, server_cpu0 = os.times(), time.perf_counter(), server.cpu_seconds()
    await asyncio.sleep(duration)
    measuring = False
    elapsed = time.perf_counter() - t0
    server_cpu = server.cpu_seconds() - server_cpu0
    stop = True
    await asyncio.gather(*tasks, return_exceptions=True)
    latencies.sort()
    return {
        "connections": connections,
        "keys_per_request": LOOKUP_KEYS,
        "requests": len(latencies),
        "errors": errors,
        "seconds": elapsed,
        "requests_per_s": len(latencies) / elapsed,
        "p50_ms": _percentile(latencies, 0.50) * 1e3,
        "p99_ms": _percentile(latencies, 0.99) * 1e3,
        "max_ms": latencies[-1] * 1e3 if latencies else float("nan"),
        "client_cpu_s": (os.times().user - cpu0.user) + (os.times().system - cpu0.system),
        "server_cpu_per_s": server_cpu / elapsed,
        "server_cpu_us_per_request": server_cpu / max(len(latencies), 1) * 1e6,
    }


_TS = re.compile(rb'"timestamp":([0-9.e+]+)')
_GAP = re.compile(rb'event: gap\ndata: \{"missed":(\d+)')


class _Subscriber:
    """A raw SSE reader that counts events cheaply (regexes over whole chunks)."""

    def __init__(self, port: int, first_seq: int) -> None:
        self.port = port
        self.last_id = first_seq - 1
        self.received = 0
        self.missed = 0
        self.resumes = 0
        self.lags: list[float] = []
        self.connected = asyncio.Event()

    async def run(self, until_seq: asyncio.Future[int]) -> None:
        while True:
            try:
                await self._stream(until_seq)
                return
            except (OSError, asyncio.IncompleteReadError):
                self.resumes += 1

    async def _stream(self, until_seq: asyncio.Future[int]) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(
            f"GET /v1/events HTTP/1.1\r\nHost: bench\r\n"
            f"Accept: text/event-stream\r\nLast-Event-ID: {self.last_id}\r\n\r\n".encode()
        )
        await reader.readuntil(b"\r\n\r\n")
        self.connected.set()
        buffer = b""
        try:
            while True:
                if until_seq.done() and self.last_id >= until_seq.result():
                    return
                data = await reader.read(1 << 20)
                if not data:
                    raise asyncio.IncompleteReadError(b"", None)
                now = time.time()
                buffer += data
                cut = buffer.rfind(b"\n\n")
                if cut < 0:
                    continue
                chunk, buffer = buffer[: cut + 2], buffer[cut + 2 :]
                last = chunk.rfind(b"id: ")
                if last < 0:
                    continue
                if b"event: gap" in chunk:
                    self.missed += sum(int(g) for g in _GAP.findall(chunk))
                self.received += chunk.count(b"event: stored\n")
                self.last_id = int(chunk[last + 4 : chunk.index(b"\n", last)])
                ts = _TS.search(chunk)
                if ts:
                    self.lags.append(now - float(ts.group(1)))
        finally:
            writer.close()


async def bench_sse(server: _Server, subscribers: int, rate: float, duration: float) -> dict:
    port = server.port
    _, body = await _request(port, b"GET /bench/emit HTTP/1.1\r\nHost: b\r\n\r\n")
    first_seq = json.loads(body)["last_seq"] + 1
    subs = [_Subscriber(port, first_seq) for _ in range(subscribers)]
    loop = asyncio.get_running_loop()
    until: asyncio.Future[int] = loop.create_future()
    tasks = [asyncio.create_task(s.run(until)) for s in subs]
    await asyncio.wait_for(asyncio.gather(*(s.connected.wait() for s in subs)), 30)
    server_cpu0, client_cpu0 = server.cpu_seconds(), os.times()
    _, body = await _request(port, _post(f"/bench/emit?rate={rate}&seconds={duration}", b""))
    if json.loads(body)["first_seq"] != first_seq:
        raise RuntimeError("events were published before the measurement")
    await asyncio.sleep(duration)
    while True:
        _, body = await _request(port, b"GET /bench/emit HTTP/1.1\r\nHost: b\r\n\r\n")
        info = json.loads(body)
        if not info["running"]:
            break
        await asyncio.sleep(0.05)
    published = info["count"]
    server_cpu = server.cpu_seconds() - server_cpu0
    now = os.times()
    client_cpu = (now.user - client_cpu0.user) + (now.system - client_cpu0.system)
    until.set_result(info["last_seq"])
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=max(30.0, duration * 3))
        drained = True
    except TimeoutError:
        drained = False
        for t in tasks:
            t.cancel()
    lags = sorted(lag for s in subs for lag in s.lags)
    lost = [published - s.received for s in subs]
    return {
        "subscribers": subscribers,
        "event_rate_target": rate,
        "seconds": duration,
        "first_seq": first_seq,
        "published": published,
        "published_per_s": published / duration,
        "delivered": sum(s.received for s in subs),
        "delivered_per_s": sum(s.received for s in subs) / duration,
        "lost_total": sum(lost),
        "lost_max_per_subscriber": max(lost),
        "gap_missed_total": sum(s.missed for s in subs),
        "resumes": sum(s.resumes for s in subs),
        "drained": drained,
        "server_cpu_per_s": server_cpu / duration,
        "client_cpu_per_s": client_cpu / duration,
        "lag_p50_ms": _percentile(lags, 0.5) * 1e3,
        "lag_p99_ms": _percentile(lags, 0.99) * 1e3,
        "lag_max_ms": (lags[-1] * 1e3) if lags else float("nan"),
    }


def _versions() -> dict[str, str | None]:
    out = {}
    for dist in ("fastapi", "starlette", "uvicorn", "uvloop", "httptools", "pydantic",
                 "sse-starlette", "orjson", "prometheus-client"):  # fmt: skip
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _print(lookup: dict | None, sse: dict | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    if lookup:
        t = Table(title=f"POST /v1/lookup, {LOOKUP_KEYS} keys, {lookup['connections']} connections")
        for col in ("req/s", "p50 ms", "p99 ms", "max ms", "requests", "errors", "server CPU/s",
                    "server us/req"):  # fmt: skip
            t.add_column(col, justify="right")
        t.add_row(
            f"{lookup['requests_per_s']:,.0f}",
            f"{lookup['p50_ms']:.2f}",
            f"{lookup['p99_ms']:.2f}",
            f"{lookup['max_ms']:.2f}",
            f"{lookup['requests']:,}",
            str(lookup["errors"]),
            f"{lookup['server_cpu_per_s']:.2f}",
            f"{lookup['server_cpu_us_per_request']:.0f}",
        )
        console.print(t)
    if sse:
        t = Table(
            title=f"GET /v1/events, {sse['subscribers']} subscribers, "
            f"{sse['event_rate_target']:,.0f} events/s target"
        )
        for col in ("published/s", "delivered/s", "lost", "gap missed", "resumes", "lag p50 ms",
                    "lag p99 ms", "drained", "server CPU/s", "client CPU/s"):  # fmt: skip
            t.add_column(col, justify="right")
        t.add_row(
            f"{sse['published_per_s']:,.0f}",
            f"{sse['delivered_per_s']:,.0f}",
            f"{sse['lost_total']:,}",
            f"{sse['gap_missed_total']:,}",
            str(sse["resumes"]),
            f"{sse['lag_p50_ms']:.1f}",
            f"{sse['lag_p99_ms']:.1f}",
            str(sse["drained"]),
            f"{sse['server_cpu_per_s']:.2f}",
            f"{sse['client_cpu_per_s']:.2f}",
        )
        console.print(t)


async def _run(args: argparse.Namespace) -> tuple[dict | None, dict | None]:
    server = _Server()
    try:
        await server.wait_ready()
        lookup = sse = None
        if args.only in (None, "lookup"):
            lookup = await bench_lookup(server, args.connections, args.duration, args.warmup)
        if args.only in (None, "sse"):
            sse = await bench_sse(server, args.subscribers, args.event_rate, args.duration)
        return lookup, sse
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.http", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--only", choices=["lookup", "sse"])
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--subscribers", type=int, default=50)
    parser.add_argument("--event-rate", type=float, default=20_000)
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--no-json", action="store_true", help="do not write bench/out/*.json")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    import uvloop

    lookup, sse = uvloop.run(_run(args))
    _print(lookup, sse)
    if not args.no_json:
        from bench._common import write_json

        path = write_json(
            "http", {"versions": _versions(), "results": {"lookup": lookup, "sse": sse}}
        )
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
