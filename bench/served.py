"""The service as users run it, against a bare FastAPI route, driven by an external load generator.

    python -m bench.served [--duration 8] [--connections 32] [--rounds 2]

Starts ``kvcache-offload serve`` with its defaults (the installed command, nothing tuned) and,
as the floor, a bare FastAPI app whose one route parses the same body into a pydantic model
and decodes its 64 hex keys, both under uvicorn (uvloop + httptools) on 127.0.0.1. ``wrk``
(Debian package ``wrk``; one thread, ``--connections`` connections) sends ``POST /v1/lookup``
with 64 hex keys to each in turn, ``--rounds`` times, so drifts in the machine hit both.
Prints requests/s and latency percentiles per round, the ratio served/bare, and writes JSON to
``bench/out/served.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import OUT_DIR, machine_info

ROOT = Path(__file__).resolve().parents[1]
KEYS = [(b"%032d" % i).hex() + "00000000" for i in range(64)]

BARE_APP = """
from fastapi import FastAPI
from pydantic import BaseModel

app = FastAPI()


class Body(BaseModel):
    keys: list[str]


@app.post("/v1/lookup")
async def lookup(body: Body) -> dict:
    keys = [bytes.fromhex(k) for k in body.keys]
    return {"hits": 0, "pending": False, "states": ["absent"] * len(keys)}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s")


def wrk(port: int, script: Path, duration: int, connections: int) -> dict[str, float]:
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency", "-s", str(script),
         f"http://127.0.0.1:{port}/v1/lookup"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    result = {"requests_per_s": rate}
    for pct in ("50", "99"):
        m = re.search(rf"\s{pct}%\s+([\d.]+)(us|ms|s)", out)
        if m:
            scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]
            result[f"p{pct}_ms"] = float(m.group(1)) * scale
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    result["non_2xx"] = float(non2xx.group(1)) if non2xx else 0.0
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.served", description=__doc__)
    p.add_argument("--duration", type=int, default=8)
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=OUT_DIR / "served.json")
    args = p.parse_args(argv)
    if shutil.which("wrk") is None:
        sys.exit("bench.served needs wrk (Debian: apt-get install wrk)")
    bindir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        (tmpdir / "bare_app.py").write_text(BARE_APP)
        (tmpdir / "body.json").write_text(json.dumps({"keys": KEYS}))
        script = tmpdir / "post.lua"
        script.write_text(
            'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
            f'local f = io.open("{tmpdir / "body.json"}")\nwrk.body = f:read("*a")\nf:close()\n'
        )
        served_port, bare_port = free_port(), free_port()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        procs = [
            subprocess.Popen(
                [str(bindir / "kvcache-offload"), "serve", "--port", str(served_port)],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ),
            subprocess.Popen(
                [str(bindir / "uvicorn"), "bare_app:app", "--port", str(bare_port),
                 "--loop", "uvloop", "--http", "httptools", "--no-access-log"],
                cwd=tmpdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ),
        ]  # fmt: skip
        rows: list[dict[str, Any]] = []
        try:
            wait_ready(served_port)
            wait_ready(bare_port)
            for port in (served_port, bare_port):  # warm-up
                wrk(port, script, 2, args.connections)
            for rnd in range(args.rounds):
                for name, port in (("served", served_port), ("bare FastAPI", bare_port)):
                    rows.append({"round": rnd, "target": name,
                                 **wrk(port, script, args.duration, args.connections)})  # fmt: skip
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=20)
    print(f"{'round':>5}  {'target':<13} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'non-2xx':>8}")
    for r in rows:
        print(f"{r['round']:>5}  {r['target']:<13} {r['requests_per_s']:>9.0f} "
              f"{r.get('p50_ms', float('nan')):>8.2f} {r.get('p99_ms', float('nan')):>8.2f} "
              f"{r['non_2xx']:>8.0f}")  # fmt: skip
    ratios = []
    for rnd in range(args.rounds):
        s = next(r for r in rows if r["round"] == rnd and r["target"] == "served")
        b = next(r for r in rows if r["round"] == rnd and r["target"] == "bare FastAPI")
        ratios.append(s["requests_per_s"] / b["requests_per_s"])
    print("served / bare:", ", ".join(f"{x:.2f}" for x in ratios))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()},
             "rows": rows, "served_over_bare": ratios},
            indent=1,
        )
    )  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
