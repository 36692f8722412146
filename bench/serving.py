"""Serving-traffic benchmark: what an embedding server feels from ``await engine.load/store``.

    python -m bench.serving [--device auto|cuda|cpu] [--layouts llama8b,tp4_70b,cross_layer]
                            [--mechanisms auto,kernel,dma,staged] [--reps 200] [--stream-s 3]
                            [--sweep 2,8] [--pace-ms 1]

Uses the public API the way a serving engine does: one ``OffloadEngine`` built from the
default ``OffloadConfig`` (only ``transfer.mechanism`` changes between the non-default rows),
``await engine.load(keys, gpu_blocks)`` per request and ``await engine.store(...)`` per step.

1. **Single job**: wall time of one ``await`` for 1, 8 and 64 offloaded blocks, ``--reps``
   times, p50 and p99, against the *floor*: one contiguous copy of the same number of bytes
   between pinned host memory and the GPU plus ``event.synchronize()``, timed the same way in
   the same process (CPU device: one ``memcpy`` of the same bytes in the calling thread).
2. **Stream**: ``--tasks`` asyncio tasks, each looping over jobs on its own keys and GPU
   blocks for ``--stream-s`` seconds: 4-block loads only, 4-block stores only (fresh keys each
   job, so every store copies), half loading and half storing, and 1-block loads. GB/s against
   the bulk rate measured in the same run, one 1 GiB copy in the stream's own direction (to
   the GPU for loads and the mixed row, to the CPU for stores: "bulk one way each"; both ways
   at once for the mixed row's bound; CPU device: one thread copying the same jobs' bytes),
   job p50/p99 against 2 x (bytes in flight / bulk rate), and the host CPU the process used
   (cores). ``--sweep``
   adds one-way load and store streams of other job sizes (where the kernel and the copy
   engines cross over).
3. **Goals**: the serving goals checked against the ``auto`` column (``bench/_serving_goals.py``).
4. **Paced single jobs** (``--pace-ms``, 1 by default; 0: none): 1-block loads and stores
   with the event loop idle for that long before each, and the floor paced alike. Back to
   back, the host path runs on a core kept busy by the job before; a lone request at low
   load finds the loop thread asleep, and its path then runs slower (``--device cpu`` on a
   2-vCPU VM, three runs: 1-block loads +67 to +89 us over a paced floor of 49-56 us,
   against +33 to +54 us over 13-19 us back to back). A secondary row: the goals are
   stated for back-to-back jobs.

The columns' engines are open together and take turns on every measurement, the single-job
floor with them, the order reversed every pass (``bench_layout``): the host's speed drifts
over seconds on the machines this ran on, and each stream prints a host probe next to its
rate.

Prints one table per section and writes JSON under ``bench/out/``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from bench._common import OUT_DIR, machine_info
from bench._serving_goals import check_goals
from kvcache_offload import KVCacheLayout, OffloadConfig, TransferTuning, make_offload_key
from kvcache_offload.aio import OffloadEngine
from kvcache_offload.contracts.kv_caches import CanonicalKVCaches
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.dataplane import layouts
from kvcache_offload.errors import BlockStateError

console = Console(width=180)
MiB = 1024 * 1024
SINGLE_SIZES = (1, 8, 64)
STREAM_JOB_BLOCKS = 4


@dataclass(frozen=True)
class Layout:
    name: str
    describe: str
    build: Callable[[int, str], CanonicalKVCaches]


def _random(shape: tuple[int, ...], device: str, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    n = 2
    for d in shape:
        n *= d
    raw = torch.empty(n, dtype=torch.uint8, device=device)
    raw.random_(0, 256, generator=gen)
    return raw.view(torch.bfloat16).view(shape)


def _blocks_first(layers: int, heads: int) -> Callable[[int, str], CanonicalKVCaches]:
    def build(num_blocks: int, device: str) -> CanonicalKVCaches:
        tensors = [_random((num_blocks, 2, 16, heads, 128), device, seed) for seed in range(layers)]
        return layouts.blocks_first_per_layer(tensors)

    return build


def _kv_first(layers: int, heads: int) -> Callable[[int, str], CanonicalKVCaches]:
    def build(num_blocks: int, device: str) -> CanonicalKVCaches:
        tensors = [_random((2, num_blocks, 16, heads, 128), device, seed) for seed in range(layers)]
        return layouts.kv_first_per_layer(tensors)

    return build


def _cross(num_blocks: int, device: str) -> CanonicalKVCaches:
    return layouts.cross_layer(_random((num_blocks, 32, 2, 16, 8, 128), device, 7))


LAYOUTS = {
    "llama8b": Layout(
        "llama8b", "32 layers x (blocks, 2, 16, 8, 128) bf16: 32 x 64 KiB", _blocks_first(32, 8)
    ),
    "tp4_70b": Layout(
        "tp4_70b", "80 layers x K,V (2, blocks, 16, 2, 128) bf16: 160 x 8 KiB", _kv_first(80, 2)
    ),
    "cross_layer": Layout("cross_layer", "one 2 MiB piece per block", _cross),
    "cpu_small": Layout(
        "cpu_small", "8 layers x (blocks, 2, 16, 4, 128) bf16: 8 x 32 KiB", _blocks_first(8, 4)
    ),
}


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if len(values) else float("nan")


# -- floors -----------------------------------------------------------------------------------


class Floors:
    """The physical limits, measured in this process: one contiguous copy per job size."""

    def __init__(self, device: str, max_bytes: int) -> None:
        self.device = device
        if device == "cuda":
            self.host = torch.empty(max_bytes, dtype=torch.uint8, pin_memory=True)
            self.gpu = torch.empty(max_bytes, dtype=torch.uint8, device="cuda")
            self.host.random_(0, 256)
            self.gpu.random_(0, 256)
            self.event = torch.cuda.Event()
            self.stream = torch.cuda.Stream()
        else:
            self.src = np.random.default_rng(0).integers(0, 256, max_bytes, dtype=np.uint8)
            self.dst = np.empty_like(self.src)

    def job(self, nbytes: int, to_gpu: bool, reps: int, gap_s: float = 0.0) -> list[float]:
        """Wall seconds of one contiguous copy of ``nbytes`` (+ event wait on CUDA), each
        after the thread slept ``gap_s`` (as the paced jobs' loop does)."""
        out = []
        for _ in range(reps + 5):
            if gap_s:
                time.sleep(gap_s)
            t0 = time.perf_counter()
            if self.device == "cuda":
                with torch.cuda.stream(self.stream):
                    if to_gpu:
                        self.gpu[:nbytes].copy_(self.host[:nbytes], non_blocking=True)
                    else:
                        self.host[:nbytes].copy_(self.gpu[:nbytes], non_blocking=True)
                    self.event.record(self.stream)
                self.event.synchronize()
            else:
                ctypes.memmove(self.dst.ctypes.data, self.src.ctypes.data, nbytes)
            out.append(time.perf_counter() - t0)
        return out[5:]

    def bulk(self, nbytes: int, both: bool = False, to_gpu: bool = True) -> float:
        """Bytes/s of one big copy one way (to the GPU, or with ``to_gpu`` False to the CPU;
        ``both``: H2D and D2H at once, summed)."""
        if self.device != "cuda":
            return self.host_stream_rate(nbytes)
        half = nbytes // 2 if both else nbytes
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        best = 0.0
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.stream(s1):
                if to_gpu:
                    self.gpu[:half].copy_(self.host[:half], non_blocking=True)
                else:
                    self.host[:half].copy_(self.gpu[:half], non_blocking=True)
            if both:
                with torch.cuda.stream(s2):
                    self.host[half : 2 * half].copy_(self.gpu[half : 2 * half], non_blocking=True)
            torch.cuda.synchronize()
            moved = 2 * half if both else half
            best = max(best, moved / (time.perf_counter() - t0))
        return best

    def host_stream_rate(self, job_bytes: int, tasks: int = 32, seconds: float = 1.0) -> float:
        """One thread copying ``tasks`` distinct jobs' bytes round-robin (CPU device)."""
        n = min(len(self.src) // job_bytes, tasks)
        src, dst = self.src.ctypes.data, self.dst.ctypes.data
        moved = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for i in range(n):
                ctypes.memmove(dst + i * job_bytes, src + i * job_bytes, job_bytes)
            moved += n * job_bytes
        return moved / (time.perf_counter() - t0)


# -- the engine under test -------------------------------------------------------------------


class Rig:
    """One engine over one layout; keys and GPU blocks handed out so tasks never share."""

    def __init__(self, layout: Layout, device: str, mechanism: str, num_gpu_blocks: int) -> None:
        self.mechanism = mechanism
        """The column this engine measures (``auto``, ``kernel``, ``auto+off``, ...)."""
        self.kv = layout.build(num_gpu_blocks, device)
        self.block_bytes = layouts.block_nbytes(self.kv)
        # "auto+off" (a staged_when_busy value after a "+") or "auto+gc_freeze=0" (any
        # TransferTuning or OffloadConfig field): auto with that setting, a column next to
        # the default's in the same run; everything not named keeps the default.
        mechanism, *options = mechanism.split("+")
        overrides: dict[str, Any] = {}
        transfer: dict[str, Any] = {"mechanism": mechanism}
        for option in options:
            key, eq, value = option.partition("=")
            if not eq:
                transfer["staged_when_busy"] = option
            elif key in TransferTuning.model_fields:
                transfer[key] = value
            else:
                overrides[key] = value
        config = OffloadConfig(
            cpu_bytes_to_use=1024 * self.block_bytes,
            transfer=TransferTuning(**transfer),
            **overrides,
            layout=KVCacheLayout(
                gpu_block_sizes=[16],
                bytes_per_block=self.block_bytes,
                num_gpu_blocks=num_gpu_blocks,
            ),
        )
        self.engine = OffloadEngine(config, kv_caches=self.kv)
        self._ids = itertools.count()

    def fresh_keys(self, n: int) -> list[OffloadKey]:
        return [make_offload_key(next(self._ids).to_bytes(8, "little"), 0) for _ in range(n)]


async def single_jobs(
    rig: Rig,
    n: int,
    reps: int,
    copies: dict[str, list[float]] | None = None,
    gap_s: float = 0.0,
) -> tuple[list[float], list[float]]:
    """Wall times of ``reps`` single loads, then of ``reps`` single stores, of ``n`` blocks
    (after five unmeasured ones each). ``copies``, when given, gets each measured job's copy
    time as the public result reports it (``transfer_seconds``: the GPU's start-to-end time
    of the copy on CUDA) under "load" and "store": the wall time minus it is what the host
    and the completion path added. ``gap_s``: the loop idles that long before each job."""
    engine = rig.engine
    keys = rig.fresh_keys(n)
    blocks = list(range(n))
    await engine.store(keys, blocks)
    loads, load_copies = [], []
    for _ in range(reps + 5):
        if gap_s:
            await asyncio.sleep(gap_s)
        t0 = time.perf_counter()
        loaded = await engine.load(keys, blocks)
        loads.append(time.perf_counter() - t0)
        load_copies.append(loaded.transfer_seconds)
    stores, store_copies = [], []
    for _ in range(reps + 5):
        fresh = rig.fresh_keys(n)
        if gap_s:
            await asyncio.sleep(gap_s)
        t0 = time.perf_counter()
        stored = await engine.store(fresh, blocks)
        stores.append(time.perf_counter() - t0)
        store_copies.append(stored.transfer_seconds)
    if copies is not None:
        copies.setdefault("load", []).extend(load_copies[5:])
        copies.setdefault("store", []).extend(store_copies[5:])
    return loads[5:], stores[5:]


@dataclass
class StreamResult:
    name: str
    bytes_moved: int
    seconds: float
    job_times: list[float]
    cpu_cores: float
    bytes_in_flight: int
    pass_rates: tuple[float, ...] = ()
    """Pooled results: each pass's rate (a stall in one engine shows as one low pass)."""
    reloads: int = 0
    """Loads that found a block of theirs evicted and stored it again first (the policy's
    choice: a scheduler would have seen the miss in its lookup)."""
    host_probe_s: float = 0.0
    """:func:`host_probe` around the stream (mean of before and after): how fast the host ran
    the same fixed Python work at the time (see :func:`host_probe`)."""
    paths: dict[str, dict[str, int]] = field(default_factory=dict)
    """Jobs each path took during this stream, per direction (the CUDA handlers'
    ``jobs_by_mechanism``; empty where the handlers do not count), and under "poller" its
    polls and sleeps. A mixed stream's rate follows its stores' path from one engine to the
    next (docs/transfers.md, the `auto` rule), which the engine's totals over all its
    streams do not show."""
    thread_cores: dict[str, float] = field(default_factory=dict)
    """Cores by thread during this stream (:func:`thread_cpu`): ``loop`` is the event-loop
    thread, the others are named as the process named them (Linux only; else empty)."""

    def kernel_share(self, direction: str) -> float | None:
        """The share of this stream's jobs of ``direction`` that took the kernel, or None."""
        counts = self.paths.get(direction)
        total = sum(counts.values()) if counts else 0
        return counts.get("kernel", 0) / total if counts and total else None

    @property
    def cpu_s_per_job(self) -> float:
        return self.cpu_cores * self.seconds / max(1, len(self.job_times))

    @property
    def rate(self) -> float:
        return self.bytes_moved / self.seconds


def thread_cpu() -> dict[str, float]:
    """CPU seconds each thread of this process has used, by thread name (digits dropped, so
    a pool's threads add up), the calling thread as ``loop``, a thread not started from
    Python as ``native:`` and its kernel name (``native:cuda-EvtHandlr``: the CUDA driver's
    event thread); from ``/proc`` (empty where there is none). Tells the event-loop
    thread's share of a stream's cores from the watchers', copy threads' and the runtime's
    own."""
    task_dir = "/proc/self/task"
    if not os.path.isdir(task_dir):
        return {}
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    me = threading.get_native_id()
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for entry in os.listdir(task_dir):
        try:
            with open(f"{task_dir}/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        tid = int(entry)
        if tid == me:
            name = "loop"
        elif tid in names:
            name = names[tid].rstrip("0123456789-_ ") or "native"
        else:
            kernel = _kernel_name(task_dir, entry).rstrip("0123456789-_ ")
            name = f"native:{kernel}" if kernel else "native"
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _kernel_name(task_dir: str, entry: str) -> str:
    """A thread's name as the kernel knows it ("" when it ended meanwhile)."""
    try:
        with open(f"{task_dir}/{entry}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _cores_between(
    before: dict[str, float], after: dict[str, float], wall: float
) -> dict[str, float]:
    return {k: round((v - before.get(k, 0.0)) / wall, 3) for k, v in after.items()}


def host_probe(reps: int = 5) -> float:
    """Seconds the host takes for a fixed piece of Python and numpy work (the median of
    ``reps``). On the lent H200 VMs the host's speed drifts over seconds: one engine's
    1-block load stream cost 35 us of CPU per job in one phase and 57-72 us in the next, with
    the code unchanged (docs/transfers.md, "How to measure a change"), and these streams are
    bound by the event-loop thread. A probe next to each stream says which phase the stream ran
    in."""
    times = []
    arr = np.arange(64)
    for _ in range(reps):
        t0 = time.perf_counter()
        table: dict[int, int] = {}
        acc = 0
        for i in range(2000):
            table[i & 63] = i
            acc += len(table) + i % 7
        for _ in range(50):
            arr = arr + 1
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


async def stream(
    rig: Rig, name: str, tasks: int, job_blocks: int, loaders: int, seconds: float
) -> StreamResult:
    """``loaders`` of ``tasks`` load, the rest store; each on its own keys and GPU blocks."""
    engine = rig.engine
    job_bytes = job_blocks * rig.block_bytes
    load_keys = [rig.fresh_keys(job_blocks) for _ in range(loaders)]
    gpu = [list(range(i * job_blocks, (i + 1) * job_blocks)) for i in range(tasks)]
    for keys, blocks in zip(load_keys, gpu, strict=False):
        await engine.store(keys, blocks)
    times: list[float] = []
    moved = 0
    reloads = 0
    deadline = 0.0

    async def loader(i: int) -> None:
        nonlocal moved, reloads
        while time.perf_counter() < deadline:
            await engine.touch(load_keys[i])  # as a scheduler does: keeps them from eviction
            t0 = time.perf_counter()
            try:
                await engine.load(load_keys[i], gpu[i])
            except BlockStateError:
                # The policy evicted one of them meanwhile (a scheduler's lookup would have
                # missed): store them again rather than fail the stream; counted apart.
                await engine.store(load_keys[i], gpu[i])
                reloads += 1
                continue
            times.append(time.perf_counter() - t0)
            moved += job_bytes

    async def storer(i: int) -> None:
        nonlocal moved
        while time.perf_counter() < deadline:
            keys = rig.fresh_keys(job_blocks)
            t0 = time.perf_counter()
            await engine.store(keys, gpu[i])
            times.append(time.perf_counter() - t0)
            moved += job_bytes

    probe_before = host_probe()
    paths_before = _paths(rig)
    threads_before = thread_cpu()
    cpu0, t0 = time.process_time(), time.perf_counter()
    deadline = t0 + seconds
    async with asyncio.TaskGroup() as tg:
        for i in range(tasks):
            tg.create_task(loader(i) if i < loaders else storer(i))
    wall = time.perf_counter() - t0
    cores = (time.process_time() - cpu0) / wall
    thread_cores = _cores_between(threads_before, thread_cpu(), wall)
    paths = _paths_since(paths_before, _paths(rig))
    probe = (probe_before + host_probe()) / 2
    return StreamResult(
        name,
        moved,
        wall,
        times,
        cores,
        tasks * job_bytes,
        reloads=reloads,
        host_probe_s=probe,
        paths=paths,
        thread_cores=thread_cores,
    )


def _paths(rig: Rig) -> dict[str, dict[str, int]]:
    """Jobs per path so far, per direction (see :func:`_jobs_by_mechanism`), and under
    "poller" its polls and the times it stopped looking with copies queued behind."""
    return {
        # A handler's entry holds its counts under "jobs_by_mechanism" (None where it does
        # not count); the poller's entry is its counts.
        direction: dict(info.get("jobs_by_mechanism", info) or {})
        for direction, info in _jobs_by_mechanism(rig).items()
    }


def _paths_since(
    before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]
) -> dict[str, dict[str, int]]:
    """The jobs each path took between two :func:`_paths` counts (non-zero only)."""
    out: dict[str, dict[str, int]] = {}
    for direction, counts in after.items():
        earlier = before.get(direction, {})
        moved = {m: n - earlier.get(m, 0) for m, n in counts.items() if n - earlier.get(m, 0)}
        if moved:
            out[direction] = moved
    return out


# -- driver -----------------------------------------------------------------------------------


def stream_specs(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(name, blocks per job, loading tasks) of every stream, in the order they run."""
    tasks = args.tasks
    specs = [
        ("loads 4-block", STREAM_JOB_BLOCKS, tasks),
        ("stores 4-block", STREAM_JOB_BLOCKS, 0),
        ("mixed 4-block", STREAM_JOB_BLOCKS, tasks // 2),
        ("loads 1-block", 1, tasks),
    ]
    # One-way streams of other job sizes: where the kernel and the copy engines cross over
    # is what sets staged_one_way_min_*_bytes (docs/transfers.md).
    for n in args.sweep_blocks:
        for name, loaders in ((f"loads {n}-block", tasks), (f"stores {n}-block", 0)):
            if name not in {spec[0] for spec in specs}:
                specs.append((name, n, loaders))
    return specs


def _jobs_by_mechanism(rig: Rig) -> dict[str, Any]:
    handlers = rig.engine.worker.handlers if rig.engine.worker is not None else []
    out = {}
    for i, h in enumerate(handlers):
        info = h.describe() if hasattr(h, "describe") else {}
        out[info.get("direction", str(i))] = {
            k: info.get(k) for k in ("jobs_by_mechanism", "batches", "batched_jobs")
        }
    poller = rig.engine._poller
    if poller is not None:  # how often it stopped looking with copies queued behind
        out["poller"] = {
            "polls": poller.polls,
            "deep_sleeps": poller.deep_sleeps,
            "close_finds": poller.close_finds,
            "caller_finds": poller.caller_finds,
            "backstop_wakes": poller.backstop_wakes,
            "sleeps_before_flush": poller.sleeps_before_flush,
        }
    return out


async def bench_layout(
    layout: Layout, device: str, mechanisms: list[str], args: argparse.Namespace, floors: Floors
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, dict[int, list[float]]]]:
    """Every column's engine open at once; each measurement (one single-job size, one
    stream) runs on every engine in turn, the order reversed every pass, so that the columns
    meet the same host phases. On the lent H200 VMs the host's speed drifts up to 1.7x over
    seconds, and the small-job streams follow it (docs/transfers.md, "How to measure a change"): a
    column measured a minute after another compared mostly the host. The single-job floor
    takes its turn with the engines for the same reason. Returns each column's passes, each
    shaped as one engine's run (see :func:`pooled`), and the floor's single-job times."""
    widest = max([STREAM_JOB_BLOCKS, *args.sweep_blocks])
    rigs = [Rig(layout, device, m, max(args.tasks * widest, max(SINGLE_SIZES))) for m in mechanisms]
    runs: dict[str, list[dict[str, Any]]] = {
        rig.mechanism: [
            {"mechanism": rig.mechanism, "block_bytes": rig.block_bytes,
             "single": {"load": {}, "store": {}}, "copy": {"load": {}, "store": {}},
             "paced": {"load": [], "store": []}, "streams": []}
            for _ in range(args.passes)
        ]
        for rig in rigs
    }  # fmt: skip
    orders = [(index, rigs if index % 2 == 0 else rigs[::-1]) for index in range(args.passes)]
    block_bytes = rigs[0].block_bytes
    floor: dict[str, dict[int, list[float]]] = {"load": {}, "store": {}}
    paced_floor: dict[str, dict[int, list[float]]] = {"load": {}, "store": {}}
    async with contextlib.AsyncExitStack() as stack:
        for rig in rigs:
            await stack.enter_async_context(rig.engine)
        for n in SINGLE_SIZES:
            for index, order in orders:
                if index % 2 == 0:  # the floor first in even passes, last in odd ones
                    _floor_turn(floors, floor, n, block_bytes, args.reps)
                for rig in order:
                    copies: dict[str, list[float]] = {}
                    loads, stores = await single_jobs(rig, n, args.reps, copies)
                    run = runs[rig.mechanism][index]
                    run["single"]["load"][n] = loads
                    run["single"]["store"][n] = stores
                    for d in ("load", "store"):
                        run["copy"][d][n] = copies[d]
                if index % 2 == 1:
                    _floor_turn(floors, floor, n, block_bytes, args.reps)
        gap_s = args.pace_ms / 1e3
        for index, order in orders if gap_s > 0 else ():
            if index % 2 == 0:
                _floor_turn(floors, paced_floor, 1, block_bytes, args.reps, gap_s)
            for rig in order:
                loads, stores = await single_jobs(rig, 1, args.reps, gap_s=gap_s)
                paced = runs[rig.mechanism][index]["paced"]
                paced["load"].extend(loads)
                paced["store"].extend(stores)
            if index % 2 == 1:
                _floor_turn(floors, paced_floor, 1, block_bytes, args.reps, gap_s)
        for name, blocks, loaders in stream_specs(args):
            for index, order in orders:
                for rig in order:
                    result = await stream(rig, name, args.tasks, blocks, loaders, args.stream_s)
                    runs[rig.mechanism][index]["streams"].append(result)
        for rig in rigs:
            for run in runs[rig.mechanism]:
                run["jobs_by_mechanism"] = _jobs_by_mechanism(rig)
    return runs, floor, {d: paced_floor[d].get(1, []) for d in ("load", "store")}


def _floor_turn(
    floors: Floors,
    out: dict[str, dict[int, list[float]]],
    n: int,
    block_bytes: int,
    reps: int,
    gap_s: float = 0.0,
) -> None:
    """One pass of the floor's single jobs of ``n`` blocks, both ways, added to ``out``."""
    for direction in ("load", "store"):
        times = floors.job(n * block_bytes, direction == "load", reps, gap_s)
        out[direction].setdefault(n, []).extend(times)


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mechanism's passes as one run: single-job times and stream job times pooled, a
    stream's rate as all its bytes over all its seconds, its cores averaged over time."""
    first = runs[0]
    if len(runs) == 1:
        return first
    single, copy = (
        {d: {n: [t for r in runs for t in r[key][d][n]] for n in first[key][d]} for d in first[key]}
        for key in ("single", "copy")
    )
    streams = []
    for idx, s in enumerate(first["streams"]):
        parts: list[StreamResult] = [r["streams"][idx] for r in runs]
        seconds = sum(p.seconds for p in parts)
        streams.append(
            StreamResult(
                s.name,
                sum(p.bytes_moved for p in parts),
                seconds,
                [t for p in parts for t in p.job_times],
                sum(p.cpu_cores * p.seconds for p in parts) / seconds,
                s.bytes_in_flight,
                tuple(p.rate for p in parts),
                sum(p.reloads for p in parts),
                sum(p.host_probe_s * p.seconds for p in parts) / seconds,
                _summed([p.paths for p in parts]),
                _pooled_cores(parts, seconds),
            )
        )
    paced = {d: [t for r in runs for t in r["paced"][d]] for d in first["paced"]}
    return {**first, "single": single, "copy": copy, "paced": paced, "streams": streams,
            "passes": len(runs)}  # fmt: skip


def _pooled_cores(parts: list[StreamResult], seconds: float) -> dict[str, float]:
    """The passes' cores by thread, averaged over time."""
    names = {name for p in parts for name in p.thread_cores}
    return {
        name: round(sum(p.thread_cores.get(name, 0.0) * p.seconds for p in parts) / seconds, 3)
        for name in sorted(names)
    }


def _summed(counts: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for per_direction in counts:
        for direction, per_path in per_direction.items():
            into = out.setdefault(direction, {})
            for path, n in per_path.items():
                into[path] = into.get(path, 0) + n
    return out


def _us(x: float) -> str:
    return f"{x * 1e6:,.0f} us" if x < 1e-2 else f"{x * 1e3:,.2f} ms"


def _loop_share(s: StreamResult) -> str:
    """ ", loop 0.97": the event-loop thread's cores (empty where threads are not counted)."""
    loop = s.thread_cores.get("loop")
    return f", loop {loop:.2f}" if loop is not None else ""


def _kernel_shares(s: StreamResult) -> str:
    """ " kernel stores 0.55 loads 0.15 sleeps 40": the share of each direction's jobs in
    this stream that took the kernel (empty where the handlers do not count paths), and how
    often the poller stopped looking with copies queued behind (empty where it never did)."""
    shares = [
        f"{label} {share:.2f}"
        for label, direction in (("stores", "store"), ("loads", "load"))
        if (share := s.kernel_share(direction)) is not None
    ]
    sleeps = s.paths.get("poller", {}).get("deep_sleeps")
    return (f" kernel {' '.join(shares)}" if shares else "") + (
        f" sleeps {sleeps}" if sleeps else ""
    )


def _job_table(title: str, runs: list[dict[str, Any]]) -> Table:
    """A single-job table's head: the job, the floor's p50, then one column per engine."""
    table = Table(title=title)
    table.add_column("job")
    table.add_column("floor p50")
    for run in runs:
        table.add_column(run["mechanism"])
    return table


def _report_paced(
    layout: Layout,
    device: str,
    runs: list[dict[str, Any]],
    floor: dict[str, list[float]],
    pace_ms: float,
    block_bytes: int,
) -> list[dict[str, Any]]:
    """The paced 1-block jobs' table (each after the loop idled ``pace_ms``) and JSON rows."""
    if not floor["load"]:
        return []
    table = _job_table(
        f"{layout.name} on {device}: 1-block jobs after the loop idled {pace_ms:g} ms "
        "(a lone request at low load; the floor paced alike), p50 / p99",
        runs,
    )
    rows = []
    for d in ("load", "store"):
        f50 = pct(floor[d], 50)
        cells = []
        for run in runs:
            t = run["paced"][d]
            p50, p99 = pct(t, 50), pct(t, 99)
            cells.append(f"{_us(p50)} (+{_us(p50 - f50)}) / {_us(p99)}")
            rows.append({"direction": d, "blocks": 1, "mechanism": run["mechanism"],
                         "pace_s": pace_ms / 1e3, "p50_s": p50, "p99_s": p99,
                         "floor_p50_s": f50, "jobs": len(t)})  # fmt: skip
        table.add_row(f"{d} 1 ({block_bytes / MiB:g} MiB)", _us(f50), *cells)
    console.print(table)
    return rows


def stream_bulk(name: str, to_gpu: float, to_cpu: float, both_ways: float) -> tuple[float, float]:
    """(the one-way bulk rate a stream's share is taken of, the rate its p99 bound uses):
    a stores-only stream copies to the CPU, so its own direction's bulk (the issue's "bulk
    one way each"; the two directions' bulk rates differ from one machine to the next); the
    mixed stream's share is of the one-way bulk to the GPU and its bound of both ways at
    once; every other stream (loads) its bulk to the GPU."""
    if name.startswith("mixed"):
        return to_gpu, both_ways
    one_way = to_cpu if name.startswith("stores") else to_gpu
    return one_way, one_way


def report(layout: Layout, device: str, runs: list[dict[str, Any]], floors: Floors,
           args: argparse.Namespace,
           floor_single: dict[str, dict[int, list[float]]],
           floor_paced: dict[str, list[float]]) -> dict[str, Any]:  # fmt: skip
    block_bytes = runs[0]["block_bytes"]
    if device == "cuda":
        bulk_bytes = min(1024 * MiB, floors_max(floors))
        one_way = floors.bulk(bulk_bytes)
        both_ways = floors.bulk(bulk_bytes, both=True)
        to_cpu = floors.bulk(bulk_bytes, to_gpu=False)
    else:  # one thread copying the same jobs' bytes, whatever the direction
        one_way = both_ways = to_cpu = floors.host_stream_rate(
            STREAM_JOB_BLOCKS * block_bytes, args.tasks
        )
    table = _job_table(
        f"{layout.name} ({layout.describe}) on {device}: single job, p50 / p99, "
        "and the copy's own p50 (its transfer_seconds)",
        runs,
    )
    rows_json = []
    for d in ("load", "store"):
        for n in SINGLE_SIZES:
            f50 = pct(floor_single[d][n], 50)
            cells = []
            for run in runs:
                t = run["single"][d][n]
                p50, p99 = pct(t, 50), pct(t, 99)
                copy50 = pct(run["copy"][d][n], 50)
                cells.append(f"{_us(p50)} ({p50 / f50:.2f}x, +{_us(p50 - f50)}) / {_us(p99)}"
                             f" copy {_us(copy50)}")  # fmt: skip
                rows_json.append({"direction": d, "blocks": n, "mechanism": run["mechanism"],
                                  "p50_s": p50, "p99_s": p99, "floor_p50_s": f50,
                                  "ratio_p50": p50 / f50, "copy_p50_s": copy50})  # fmt: skip
            table.add_row(f"{d} {n} ({n * block_bytes / MiB:g} MiB)", _us(f50), *cells)
    console.print(table)
    paced_json = _report_paced(layout, device, runs, floor_paced, args.pace_ms, block_bytes)
    st = Table(title=f"{layout.name} on {device}: {args.tasks} concurrent tasks, GB/s (ratio)")
    st.add_column("stream")
    for run in runs:
        st.add_column(run["mechanism"])
    stream_json = []
    names = [s.name for s in runs[0]["streams"]]
    for idx, name in enumerate(names):
        cells = []
        for run in runs:
            s: StreamResult = run["streams"][idx]
            share_of, bound_bulk = stream_bulk(name, one_way, to_cpu, both_ways)
            ratio = s.rate / share_of
            bound = 2 * s.bytes_in_flight / bound_bulk
            p50, p99 = pct(s.job_times, 50), pct(s.job_times, 99)
            worst = max(s.job_times, default=0.0)
            cells.append(f"{s.rate / 1e9:.1f} ({ratio:.2f}x) p50 {_us(p50)} p99 {_us(p99)} "
                         f"[<= {_us(bound)}] max {_us(worst)} cpu {s.cpu_cores:.2f} "
                         f"({s.cpu_s_per_job * 1e6:.0f} us/job{_loop_share(s)}) host "
                         f"{s.host_probe_s * 1e6:.0f} us{_kernel_shares(s)}")  # fmt: skip
            stream_json.append({"stream": name, "mechanism": run["mechanism"],
                                "gb_s": s.rate / 1e9, "ratio_to_one_way_bulk": ratio,
                                "one_way_bulk_gb_s": share_of / 1e9,
                                "pass_gb_s": [r / 1e9 for r in s.pass_rates],
                                "p50_s": p50, "p99_s": p99, "max_s": worst,
                                "p99_bound_s": bound, "cpu_cores": s.cpu_cores,
                                "jobs": len(s.job_times), "reloads": s.reloads,
                                "cpu_s_per_job": s.cpu_s_per_job,
                                "host_probe_s": s.host_probe_s,
                                "paths": s.paths,
                                "thread_cores": s.thread_cores})  # fmt: skip
        st.add_row(name, *cells)
    console.print(st)
    probes = [s.host_probe_s for run in runs for s in run["streams"]]
    console.print(
        f"host probe (the same fixed work before and after each stream): "
        f"{min(probes) * 1e6:.0f}-{max(probes) * 1e6:.0f} us; streams bound by the event-loop "
        "thread run slower where it is slower, whatever the code"
    )
    if device == "cuda":
        console.print(
            f"floor: one-way bulk copy to the GPU {one_way / 1e9:.1f} GB/s (loads, mixed), "
            f"to the CPU {to_cpu / 1e9:.1f} GB/s (stores); both ways at once "
            f"{both_ways / 1e9:.1f} GB/s"
        )
    else:
        console.print(f"floor: one thread copying the same jobs {one_way / 1e9:.1f} GB/s")
    for run in runs:
        console.print(f"  {run['mechanism']}: jobs by mechanism {run['jobs_by_mechanism']}")
        for s in run["streams"]:
            if s.reloads:
                console.print(
                    f"  {run['mechanism']}, {s.name}: {s.reloads} loads found a block evicted "
                    "and stored it again (not timed, not counted as moved bytes)"
                )
    goals = check_goals(rows_json, stream_json, device)
    if goals:
        gt = Table(title=f"{layout.name} on {device}: serving goals, default configuration (auto)")
        gt.add_column("goal")
        gt.add_column("measured")
        gt.add_column("met")
        for g in goals:
            gt.add_row(g.goal, g.value, "yes" if g.met else "no")
        console.print(gt)
    return {
        "layout": layout.name,
        "describe": layout.describe,
        "block_bytes": block_bytes,
        "bulk_one_way_gb_s": one_way / 1e9,
        "bulk_one_way_to_cpu_gb_s": to_cpu / 1e9,
        "bulk_both_ways_gb_s": both_ways / 1e9,
        "single": rows_json,
        "paced": paced_json,
        "streams": stream_json,
        "jobs_by_mechanism": {r["mechanism"]: r["jobs_by_mechanism"] for r in runs},
        "goals": [{"goal": g.goal, "value": g.value, "met": g.met} for g in goals],
    }


def floors_max(floors: Floors) -> int:
    return int(floors.host.numel()) if floors.device == "cuda" else len(floors.src)


async def warm_up(layout: Layout, device: str, args: argparse.Namespace) -> None:
    """One throwaway engine's mixed stream before a layout's measured engines.

    On the H200 host the first engine of a process or layout ran its streams slower than the
    same mechanism's engine later in the run (cross-layer DMA: 0.76 against 0.97 of the link
    for loads in one run, 0.85 against 0.96 in the next), which penalised whichever column
    came first, ``auto`` included."""
    rig = Rig(layout, device, "auto", args.tasks * STREAM_JOB_BLOCKS)
    async with rig.engine:
        await stream(rig, "warm-up", args.tasks, STREAM_JOB_BLOCKS, args.tasks // 2, args.warmup_s)
    del rig
    if device == "cuda":
        torch.cuda.empty_cache()


def device_and_layouts(device: str, layouts: str) -> tuple[str, list[str]]:
    """The device (``auto``: CUDA when present) and the layout names (default: the three
    GPU layouts on CUDA, ``cpu_small`` on the CPU)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    names = layouts.split(",") if layouts else (
        ["llama8b", "tp4_70b", "cross_layer"] if device == "cuda" else ["cpu_small"]
    )  # fmt: skip
    return device, names


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    device, names = device_and_layouts(args.device, args.layouts)
    mechanisms = args.mechanisms.split(",")
    if device != "cuda":  # the CPU backend has one path: only auto's columns apply
        mechanisms = [m for m in mechanisms if m.split("+")[0] == "auto"] or ["auto"]
    floors = Floors(device, 1024 * MiB if device == "cuda" else 256 * MiB)
    results = []
    for name in names:
        layout = LAYOUTS[name]
        if args.warmup_s > 0:
            await warm_up(layout, device, args)
        passes, floor_single, floor_paced = await bench_layout(
            layout, device, mechanisms, args, floors
        )
        if device == "cuda":
            torch.cuda.empty_cache()
        runs = [pooled(passes[m]) for m in mechanisms]
        results.append(report(layout, device, runs, floors, args, floor_single, floor_paced))
    return {"device": device, "machine": machine_info(), "args": vars(args), "layouts": results}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--layouts", default="")
    parser.add_argument(
        "--mechanisms",
        default="auto,kernel,dma,staged",
        help="columns: a transfer.mechanism, or auto+SETTING for auto with that "
        "staged_when_busy or FIELD=VALUE of transfer or the config (e.g. auto+off, "
        "auto+gc_freeze=0)",
    )
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--stream-s", type=float, default=3.0)
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument(
        "--sweep",
        default="",
        help="also one-way load and store streams of these job sizes in blocks (e.g. 1,2,8)",
    )
    parser.add_argument(
        "--warmup-s", type=float, default=0.5, help="a throwaway engine's stream per layout"
    )
    parser.add_argument(
        "--passes",
        type=int,
        default=2,
        help="runs of every measurement on every engine, in alternating order, pooled "
        "(see bench_layout)",
    )
    parser.add_argument(
        "--loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="the event loop (the HTTP service runs on uvloop; a library user brings theirs)",
    )
    parser.add_argument(
        "--pace-ms",
        type=float,
        default=1.0,
        help="also 1-block jobs with the loop idle this long before each (a lone request at "
        "low load), the floor paced alike; 0: none",
    )
    parser.add_argument("--out", default=str(OUT_DIR / "serving.json"))
    args = parser.parse_args(argv)
    if args.passes < 1:
        parser.error("--passes must be at least 1")
    if args.pace_ms < 0:
        parser.error("--pace-ms must be 0 or more")
    try:
        args.sweep_blocks = [int(n) for n in args.sweep.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--sweep takes block counts like 1,2,8, got {args.sweep!r}")
    if any(n < 1 for n in args.sweep_blocks):
        parser.error("--sweep block counts must be at least 1")
    if args.loop == "uvloop":
        import uvloop

        result = uvloop.run(main_async(args))
    else:
        result = asyncio.run(main_async(args))
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
