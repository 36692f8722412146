"""How long ``/healthz`` waits while the service parses a large ``token_ids`` lookup.

    python -m bench.loop_stall [--tokens 1000000,4000000,22000000] [--repeats 3] [--kv-events]

Starts the installed ``kvcache-offload serve`` (defaults, this checkout's sources). A prober
thread sends ``GET /healthz`` back to back on one keep-alive connection; the main thread posts
``POST /v1/lookup`` with ``--tokens`` random token ids (0-151,999, like a large vocabulary;
``"block_size": 1048576`` so the key limit does not trigger). For each
size: the lookup's status and time, and the ``/healthz`` latencies that overlapped it (p50,
p99, max). The floor is the same probe on the idle service, measured in the same run.
``--kv-events`` serves with a shared region and a KV-event publisher and posts the ids to
``POST /v1/store/prepare`` instead, which also hands them to the publisher (then rolls the
lease back with ``success: false``, so nothing is published).
Writes JSON to ``bench/out/loop_stall-*.json``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import threading
import time
from typing import Any

import numpy as np

from bench._common import write_json
from bench._service import free_port, running_service


class _Prober(threading.Thread):
    """``GET /healthz`` in a loop; keeps (start, latency) of every answer."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        while not self.stop.is_set():
            start = time.perf_counter()
            conn.request("GET", "/healthz")
            conn.getresponse().read()
            self.samples.append((start, time.perf_counter() - start))
            time.sleep(0.002)
        conn.close()

    def between(self, t0: float, t1: float) -> list[float]:
        """Latencies (ms) of probes that were in flight at some point in [t0, t1]."""
        return [lat * 1e3 for start, lat in list(self.samples) if start <= t1 and start + lat >= t0]


def _stats(latencies_ms: list[float]) -> dict[str, float]:
    if not latencies_ms:
        return {"probes": 0}
    a = np.asarray(latencies_ms)
    return {
        "probes": len(a),
        "p50_ms": float(np.percentile(a, 50)),
        "p99_ms": float(np.percentile(a, 99)),
        "max_ms": float(a.max()),
    }


def _body(tokens: int, rng: np.random.Generator) -> bytes:
    ids = rng.integers(0, 152_000, tokens)
    return (
        b'{"block_size":1048576,"token_ids":[' + ",".join(map(str, ids.tolist())).encode() + b"]}"
    )


def _roll_back(conn: http.client.HTTPConnection, lease_id: str) -> None:
    body = json.dumps({"lease_id": lease_id, "success": False})
    conn.request("POST", "/v1/store/complete", body, {"Content-Type": "application/json"})
    conn.getresponse().read()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.loop_stall", description=__doc__)
    p.add_argument("--tokens", default="1000000,4000000,22000000")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-json", action="store_true")
    p.add_argument(
        "--kv-events", action="store_true",
        help="prepare stores (shared region, KV events on) instead of looking up",
    )  # fmt: skip
    args = p.parse_args(argv)
    path, serve_args = "/v1/lookup", []
    if args.kv_events:
        path = "/v1/store/prepare"
        serve_args = ["--shared-region", "--region-name", f"loop-stall-{os.getpid()}",
                      "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}"]  # fmt: skip
    rng = np.random.default_rng(6)
    sizes = [int(t) for t in args.tokens.split(",")]
    bodies = {n: _body(n, rng) for n in sizes}
    rows: list[dict[str, Any]] = []
    with running_service(serve_args) as (port, _proc):
        prober = _Prober(port)
        prober.start()
        time.sleep(1.0)
        t0 = time.perf_counter()
        time.sleep(2.0)
        rows.append({"body": "idle (floor)", **_stats(prober.between(t0, time.perf_counter()))})
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        for n in sizes:
            for rep in range(args.repeats):
                body = bodies[n]
                t0 = time.perf_counter()
                status: int | str
                try:
                    conn.request("POST", path, body, {"Content-Type": "application/json"})
                    response = conn.getresponse()
                    answer = response.read()
                    status = response.status
                    closed = response.getheader("connection", "").lower() == "close"
                except (BrokenPipeError, ConnectionResetError):
                    # Refused from its Content-Length: the service closed while we still sent.
                    status, answer, closed = "closed", b"", True
                t1 = time.perf_counter()
                if closed:
                    conn.close()
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                elif args.kv_events and status == 200:
                    _roll_back(conn, json.loads(answer)["lease_id"])
                rows.append({
                    "body": f"{n:,} token ids ({len(body) / 1e6:.1f} MB)", "repeat": rep,
                    "status": status, "lookup_ms": (t1 - t0) * 1e3,
                    "answer": answer[:120].decode(errors="replace"),
                    **_stats(prober.between(t0, t1)),
                })  # fmt: skip
                time.sleep(0.3)
        prober.stop.set()
        prober.join()
        conn.close()
    print(f"{'body':<34} {'status':>6} {'call ms':>10} {'probes':>7} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'max ms':>8}")  # fmt: skip
    nan = float("nan")
    for r in rows:
        print(
            f"{r['body']:<34} {r.get('status', ''):>6} {r.get('lookup_ms', nan):>10.0f} "
            f"{r['probes']:>7} {r.get('p50_ms', nan):>8.2f} {r.get('p99_ms', nan):>8.2f} "
            f"{r.get('max_ms', nan):>8.1f}"
        )
    if not args.no_json:
        out = write_json("loop_stall", {"args": vars(args), "rows": rows})
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
