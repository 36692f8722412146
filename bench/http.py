"""HTTP service benchmark on the installed service: lookup throughput and SSE fan-out.

    python -m bench.http                      # both scenarios
    python -m bench.http --only lookup --duration 10 --connections 32 --rounds 3
    python -m bench.http --only sse --subscribers 50 --writers 32

Both scenarios start the installed ``kvcache-offload serve`` as a subprocess (this checkout's
sources, see ``bench/_service.py``) and drive it from outside with ``wrk`` (Debian package
``wrk``), so the figures are what a user's service does.

* lookup: ``python -m bench.served --ready 32`` (one scenario, one implementation): the
  service with its defaults answers ``POST /v1/lookup`` with 64 hex keys (32 of them ready)
  from ``--connections`` connections, against a bare FastAPI route parsing the same body in
  the same rounds (the floor); requests/s, p50/p99 and server CPU per request.
* sse: ``--subscribers`` raw SSE clients on ``GET /v1/events`` while ``wrk`` uploads blocks
  under new keys (``PUT /v1/blocks``) from ``--writers`` connections for ``--duration`` s.
  The one setting changed is the block size (4 KiB, ``KVCACHE_OFFLOAD_LAYOUT__BYTES_PER_BLOCK``)
  so that uploads are cheap and the tier (4096 blocks) evicts; every store and eviction is an
  event. Lost = published (the service's ``last_event_seq`` advance) - received - missed per
  subscriber (gap events count their ``missed``; a dropped connection resumes with
  Last-Event-ID and is counted). Lag = receive time - event timestamp of the oldest event in
  each chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import tempfile
import time
from importlib import metadata
from typing import Any

from bench._service import ROOT, running_service
from bench.served import cpu_seconds

BLOCK_BYTES = 4096

PUT_NEW_KEYS = """
local block = string.rep("k", %d)
local headers = {["Content-Type"] = "application/octet-stream"}
local n = 0
request = function()
  n = n + 1
  local key = string.format("%%016x%%048x%%08x", %d, n, 0)
  return wrk.format("PUT", "/v1/blocks?keys=" .. key, headers, block)
end
"""


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


async def _get_json(port: int, path: str) -> Any:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        match = re.search(rb"(?i)content-length: *(\d+)", head)
        body = await reader.readexactly(int(match.group(1))) if match else await reader.read()
        return json.loads(body)
    finally:
        writer.close()


async def _last_seq(port: int) -> int:
    return int((await _get_json(port, "/v1/stats"))["last_event_seq"])


async def _quiet_last_seq(port: int) -> int:
    await asyncio.sleep(0.3)
    return await _last_seq(port)


_TS = re.compile(rb'"timestamp":([0-9.e+]+)')
_GAP = re.compile(rb'event: gap\ndata: \{"missed":(\d+)')
_ID = re.compile(rb"id: (?:[0-9a-f]+-)?(\d+)\n")


class _Subscriber:
    """A raw SSE reader that counts events cheaply (regexes over whole chunks)."""

    def __init__(self, port: int, first_seq: int) -> None:
        self.port = port
        self.last_id = first_seq - 1  # a bare sequence number is a valid Last-Event-ID
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
                ids = _ID.findall(chunk)
                if not ids:
                    continue
                gaps = 0
                if b"event: gap" in chunk:
                    self.missed += sum(int(g) for g in _GAP.findall(chunk))
                    gaps = chunk.count(b"event: gap\n")
                self.received += len(ids) - gaps
                self.last_id = int(ids[-1])
                ts = _TS.search(chunk)
                if ts:
                    self.lags.append(now - float(ts.group(1)))
        finally:
            writer.close()


async def _upload_new_keys(port: int, writers: int, duration: float) -> str:
    """``wrk`` PUTs one 4 KiB block under a new key per request; its report."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        script.write(PUT_NEW_KEYS % (BLOCK_BYTES, os.getpid()))
        script.flush()
        proc = await asyncio.create_subprocess_exec(
            "wrk", "-t1", f"-c{writers}", f"-d{duration:g}s", "-s", script.name,
            f"http://127.0.0.1:{port}/v1/blocks", stdout=subprocess.PIPE,
        )  # fmt: skip
        return (await proc.communicate())[0].decode()


async def bench_sse(
    port: int, pid: int, subscribers: int, writers: int, duration: float
) -> dict[str, Any]:
    first_seq = await _last_seq(port) + 1
    subs = [_Subscriber(port, first_seq) for _ in range(subscribers)]
    until: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    tasks = [asyncio.create_task(s.run(until)) for s in subs]
    await asyncio.wait_for(asyncio.gather(*(s.connected.wait() for s in subs)), 30)
    server_cpu0, client_cpu0 = cpu_seconds(pid), os.times()
    out = await _upload_new_keys(port, writers, duration)
    last = await _last_seq(port)
    while (settled := await _quiet_last_seq(port)) != last:  # uploads wrk left in flight
        last = settled
    published = last - first_seq + 1
    server_cpu = cpu_seconds(pid) - server_cpu0
    now = os.times()
    client_cpu = (now.user - client_cpu0.user) + (now.system - client_cpu0.system)
    until.set_result(last)
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=max(30.0, duration * 3))
        drained = True
    except TimeoutError:
        drained = False
        for t in tasks:
            t.cancel()
    lags = sorted(lag for s in subs for lag in s.lags)
    lost = [published - s.received - s.missed for s in subs]
    uploads = re.search(r"Requests/sec:\s+([\d.]+)", out)
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    return {
        "subscribers": subscribers,
        "writers": writers,
        "seconds": duration,
        "first_seq": first_seq,
        "uploads_per_s": float(uploads.group(1)) if uploads else float("nan"),
        "upload_errors": int(non2xx.group(1)) if non2xx else 0,
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
    out: dict[str, str | None] = {}
    for dist in ("fastapi", "starlette", "uvicorn", "uvloop", "httptools", "pydantic",
                 "sse-starlette", "orjson", "prometheus-client"):  # fmt: skip
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _print(sse: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"GET /v1/events, {sse['subscribers']} subscribers, events from "
        f"{sse['writers']} wrk connections uploading blocks under new keys"
    )
    for col in ("uploads/s", "published/s", "delivered/s", "lost", "gap missed", "resumes",
                "lag p50 ms", "lag p99 ms", "drained", "server CPU/s", "client CPU/s"):  # fmt: skip
        t.add_column(col, justify="right")
    t.add_row(
        f"{sse['uploads_per_s']:,.0f}",
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
    Console(width=140).print(t)


async def _run_sse(args: argparse.Namespace) -> dict[str, Any]:
    env = {"KVCACHE_OFFLOAD_LAYOUT__BYTES_PER_BLOCK": str(BLOCK_BYTES)}
    with running_service(["--cpu-bytes", str(4096 * BLOCK_BYTES)], env=env) as (port, proc):
        deadline = time.monotonic() + 60
        while True:  # listening comes before the engine is ready
            try:
                await _last_seq(port)
                break
            except (OSError, KeyError, ValueError, asyncio.IncompleteReadError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        return await bench_sse(port, proc.pid, args.subscribers, args.writers, args.duration)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.http", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--only", choices=["lookup", "sse"])
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2, help="lookup rounds (bench.served)")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--subscribers", type=int, default=50)
    parser.add_argument("--writers", type=int, default=32)
    parser.add_argument("--no-json", action="store_true", help="do not write bench/out/*.json")
    args = parser.parse_args()
    if args.only in (None, "lookup"):
        from bench import served

        served.main(
            ["--ready", "32", "--duration", str(int(args.duration)),
             "--connections", str(args.connections), "--rounds", str(args.rounds)]
        )  # fmt: skip
    if args.only in (None, "sse"):
        import uvloop

        sse = uvloop.run(_run_sse(args))
        _print(sse)
        if not args.no_json:
            from bench._common import write_json

            path = write_json("http", {"versions": _versions(), "results": {"sse": sse}})
            print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
