"""The service as users run it, against a bare FastAPI route, driven by an external load generator.

    python -m bench.served [--duration 8] [--connections 32] [--rounds 2] [--ready 32]
                           [--also ../main] [--cpus 0,1] [--wrk-cpus 2]

Starts ``kvcache-offload serve`` with its defaults (the installed command, nothing tuned, on
this checkout's sources: ``bench/_service.py``) and, as the floor, a bare FastAPI app whose
one route parses the same body into a pydantic model and decodes its 64 hex keys, both under
uvicorn (uvloop + httptools) on 127.0.0.1. ``wrk`` (Debian package ``wrk``; one thread,
``--connections`` connections) sends ``POST /v1/lookup`` with 64 hex keys to each in turn,
``--rounds`` times, so drifts in the machine hit both. Prints per round requests/s, latency
percentiles, the server's CPU time per request (user + system, from /proc: on a shared
machine it moves far less than the rate), wrk's CPU time per request (on a 2-CPU budget the
client's share counts too) and how many CPUs other work kept busy meanwhile
(everything but that server and wrk, from /proc/stat), the ratios served/bare, and writes
JSON to ``bench/out/served.json``. ``--ready`` stores some of the keys first (``bench.http``
uses 32); ``--also`` serves a second checkout in the same rounds; ``--cpus`` pins the servers
and wrk to those CPUs (a 2-vCPU budget on a larger, quiet host); ``--wrk-cpus`` pins wrk
elsewhere instead (the servers alone on ``--cpus``).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench._common import OUT_DIR, machine_info
from bench._service import free_port, running_service, service_env, wait_listening

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


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` (Linux): a cost per request that other load on a
    shared machine does not inflate the way it inflates latency."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_cpu_seconds() -> float:
    """CPU time all processes of the machine used so far (Linux ``/proc/stat``: user, nice,
    system, irq, softirq, steal), so a round can tell how much went to other work."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """CPU time of this process's waited-for children (the wrk runs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def store_ready(port: int, count: int) -> None:
    """Upload the first ``count`` keys' blocks, so a lookup finds them ready."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", "/v1/stats")
        block = int(json.loads(conn.getresponse().read())["block_nbytes"])
        query = "&".join(f"keys={k}" for k in KEYS[:count])
        conn.request("PUT", f"/v1/blocks?{query}", bytes(block * count),
                     {"Content-Type": "application/octet-stream"})  # fmt: skip
        response = conn.getresponse()
        body = response.read()
        if response.status != 200:
            raise RuntimeError(f"storing the ready keys failed: {response.status} {body[:200]!r}")
    finally:
        conn.close()


def wrk(
    port: int, script: Path, duration: int, connections: int, prefix: list[str] | None = None
) -> dict[str, float]:
    out = subprocess.run(
        [*(prefix or []), "wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency",
         "-s", str(script), f"http://127.0.0.1:{port}/v1/lookup"],
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
    p.add_argument(
        "--ready", type=int, default=0, metavar="N",
        help="store the first N of the 64 keys first (PUT /v1/blocks), so lookups hit them",
    )  # fmt: skip
    p.add_argument(
        "--cpus", metavar="LIST",
        help="run the servers and wrk under taskset -c LIST (e.g. 0,1: a 2-CPU budget on a "
        "bigger, quiet machine)",
    )  # fmt: skip
    p.add_argument(
        "--also", type=Path, metavar="CHECKOUT",
        help="also serve another checkout's sources (e.g. the main branch) in the same rounds",
    )  # fmt: skip
    p.add_argument(
        "--wrk-cpus", metavar="LIST",
        help="run wrk under taskset -c LIST instead of on --cpus (e.g. 2: servers alone on 0,1)",
    )  # fmt: skip
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
        pin = ["taskset", "-c", args.cpus] if args.cpus else []
        wrk_cpus = args.wrk_cpus or args.cpus
        wrk_pin = ["taskset", "-c", wrk_cpus] if wrk_cpus else []
        bare_port = free_port()
        bare = subprocess.Popen(
            [*pin, str(bindir / "uvicorn"), "bare_app:app", "--port", str(bare_port),
             "--loop", "uvloop", "--http", "httptools", "--no-access-log"],
            cwd=tmpdir, env=service_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        rows: list[dict[str, Any]] = []
        try:
            with contextlib.ExitStack() as services:
                served_port, served = services.enter_context(running_service(prefix=pin))
                targets = [
                    ("served", served_port, served.pid),
                    ("bare FastAPI", bare_port, bare.pid),
                ]
                if args.also is not None:
                    port, other = services.enter_context(
                        running_service(source=args.also, prefix=pin)
                    )
                    targets.insert(1, (f"served@{args.also.name}", port, other.pid))
                wait_listening(bare_port)
                for name, port, _ in targets:
                    if name != "bare FastAPI" and args.ready:
                        store_ready(port, args.ready)
                for _, port, _ in targets:  # warm-up
                    wrk(port, script, 2, args.connections, wrk_pin)
                for rnd in range(args.rounds):
                    for name, port, pid in targets:
                        cpu, busy, load = (
                            cpu_seconds(pid),
                            busy_cpu_seconds(),
                            children_cpu_seconds(),
                        )
                        row = wrk(port, script, args.duration, args.connections, wrk_pin)
                        cpu = cpu_seconds(pid) - cpu
                        load = children_cpu_seconds() - load
                        busy = busy_cpu_seconds() - busy
                        row["server_cpu_us_per_request"] = (
                            cpu / (row["requests_per_s"] * args.duration) * 1e6
                        )
                        row["wrk_cpu_us_per_request"] = (
                            load / (row["requests_per_s"] * args.duration) * 1e6
                        )
                        # CPUs busy with anything but this server and wrk, on average.
                        row["other_cpus"] = max(0.0, busy - cpu - load) / args.duration
                        rows.append({"round": rnd, "target": name, **row})
        finally:
            bare.terminate()
            bare.wait(timeout=20)
    print(f"{'round':>5}  {'target':<13} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'CPU us/req':>10} {'wrk us/req':>10} {'other CPUs':>10} {'non-2xx':>8}")  # fmt: skip
    nan = float("nan")
    for r in rows:
        print(f"{r['round']:>5}  {r['target']:<13} {r['requests_per_s']:>9.0f} "
              f"{r.get('p50_ms', nan):>8.2f} {r.get('p99_ms', nan):>8.2f} "
              f"{r['server_cpu_us_per_request']:>10.0f} {r['wrk_cpu_us_per_request']:>10.0f} "
              f"{r['other_cpus']:>10.2f} "
              f"{r['non_2xx']:>8.0f}")  # fmt: skip
    ratios, cpu_ratios = [], []
    for rnd in range(args.rounds):
        s = next(r for r in rows if r["round"] == rnd and r["target"] == "served")
        b = next(r for r in rows if r["round"] == rnd and r["target"] == "bare FastAPI")
        ratios.append(s["requests_per_s"] / b["requests_per_s"])
        cpu_ratios.append(b["server_cpu_us_per_request"] / s["server_cpu_us_per_request"])
    print("served / bare, req/s:", ", ".join(f"{x:.2f}" for x in ratios))
    print("served / bare, requests per CPU-second:", ", ".join(f"{x:.2f}" for x in cpu_ratios))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()},
             "rows": rows, "served_over_bare": ratios,
             "served_over_bare_per_cpu_second": cpu_ratios},
            indent=1,
        )
    )  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
