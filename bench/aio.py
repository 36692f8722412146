"""Async-core benchmark: completion->resume latency, idle CPU cost, lookup overhead.

    python -m bench.aio [--device auto|cpu|cuda] [--jobs 2000] [--idle-s 10] [--trace PATH]

1. Latency from a transfer's completion to the awaiting coroutine resuming (p50/p99):
   * ``deadline``: a handler whose jobs finish at a known instant (pure poller cost, exact);
   * ``cpu_backend``: the real CPU backend
     (``kvcache_offload.dataplane.handlers.cpu_backend``) if present;
   * ``cuda``: a job of known GPU duration (``torch.cuda._sleep``) signalled by a CUDA event.
   For the real backends the completion instant is not observable from Python, so each is
   measured against a baseline in the same run: a bare loop that submits the same job and
   blocks in ``handler.wait`` (the GIL released, nothing spinning) without asyncio.
   ``added`` = engine - baseline, per percentile.
2. CPU time of an idle engine (process CPU seconds / wall seconds) over ``--idle-s``.
3. ``await engine.lookup(keys)`` against a direct maximal-prefix walk over the manager for
   the same trace (same cache state: both replay stores through the manager).

Prints rich tables and writes JSON under ``bench/out/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvcache_offload import (
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    KVCacheLayout,
    OffloadConfig,
    ReqContext,
    make_offload_key,
)
from kvcache_offload.aio import OffloadEngine
from kvcache_offload.contracts.handler import (
    OffloadingHandler,
    TransferResult,
    TransferSpec,
)
from kvcache_offload.contracts.kv_caches import CanonicalKVCaches
from kvcache_offload.contracts.load_store_spec import LoadStoreSpec
from kvcache_offload.contracts.manager import OffloadingManager
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.dataplane.spec import CPUOffloadingSpec

console = Console(width=170)
OUT_DIR = Path(__file__).parent / "out"
DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2] / "shared/traces/mooncake_conversation_trace.jsonl"
)


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def us(x: float) -> str:
    return f"{x * 1e6:.1f}"


# -- handlers used only by this benchmark ---------------------------------------------------


class DeadlineHandler(OffloadingHandler):
    """Each job 'finishes' ``delay_s`` after submission: its completion instant is known."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.queue: list[tuple[int, float]] = []
        self.done_at: dict[int, float] = {}

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        self.queue.append((job_id, time.perf_counter() + self.delay_s))
        return True

    def get_finished(self) -> list[TransferResult]:
        now = time.perf_counter()
        out = []
        while self.queue and self.queue[0][1] <= now:
            job_id, deadline = self.queue.pop(0)
            self.done_at[job_id] = deadline
            out.append(TransferResult(job_id, True, 0, self.delay_s))
        return out

    def wait(self, job_ids: set[int]) -> None:
        while self.queue:
            time.sleep(self.delay_s)
            self.get_finished()


class CudaSleepHandler(OffloadingHandler):
    """A job is a GPU sleep of ``cycles`` on a side stream, finished when its event fires."""

    def __init__(self, cycles: int) -> None:
        import torch

        self.torch = torch
        self.cycles = cycles
        self.stream = torch.cuda.Stream()
        self.queue: list[tuple[int, Any, Any]] = []

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        torch = self.torch
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record()
            torch.cuda._sleep(self.cycles)
            end.record()
        self.queue.append((job_id, start, end))
        return True

    def get_finished(self) -> list[TransferResult]:
        out = []
        while self.queue and self.queue[0][2].query():
            job_id, start, end = self.queue.pop(0)
            out.append(TransferResult(job_id, True, 0, start.elapsed_time(end) * 1e-3))
        return out

    def wait(self, job_ids: set[int]) -> None:
        self.stream.synchronize()


class HandlerSpec(CPUOffloadingSpec):
    """The CPU manager plus one given handler for both directions."""

    def __init__(self, config: OffloadConfig, handler: OffloadingHandler) -> None:
        super().__init__(config, config.layout)
        self.handler = handler

    def get_handlers(
        self, kv_caches: CanonicalKVCaches
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        yield GPULoadStoreSpec, CPULoadStoreSpec, self.handler
        yield CPULoadStoreSpec, GPULoadStoreSpec, self.handler


def small_config(num_blocks: int, bytes_per_block: int = 4096) -> OffloadConfig:
    layout = KVCacheLayout(gpu_block_sizes=[16], bytes_per_block=bytes_per_block)
    return OffloadConfig(cpu_bytes_to_use=num_blocks * bytes_per_block, layout=layout)


def key_of(i: int) -> OffloadKey:
    return make_offload_key(str(i).encode(), 0)


# -- 1. completion -> resume latency ----------------------------------------------------------


@dataclass
class Latency:
    name: str
    job_s: float
    engine: list[float]
    baseline: list[float] | None = None
    busy_cpu: float = float("nan")
    """Process CPU seconds per wall second while the engine loop ran (poller spin cost)."""

    def row(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "name": self.name,
            "job_us": self.job_s * 1e6,
            "n": len(self.engine),
            "engine_p50_us": pct(self.engine, 50) * 1e6,
            "engine_p99_us": pct(self.engine, 99) * 1e6,
            "busy_cpu_fraction": self.busy_cpu,
        }
        if self.baseline is not None:
            row["baseline_p50_us"] = pct(self.baseline, 50) * 1e6
            row["baseline_p99_us"] = pct(self.baseline, 99) * 1e6
            row["added_p50_us"] = row["engine_p50_us"] - row["baseline_p50_us"]
            row["added_p99_us"] = row["engine_p99_us"] - row["baseline_p99_us"]
        return row


async def _engine_load_latencies(
    engine: OffloadEngine,
    jobs: int,
    since_submit: Callable[[int, float, float], float],
    blocks: int = 1,
) -> tuple[list[float], float]:
    """Load ``blocks`` stored keys ``jobs`` times; ``since_submit(job_id, t_submit, t_resume)``."""
    ks = [key_of(i) for i in range(blocks)]
    await engine.store(ks, list(range(blocks)))
    dst = list(range(blocks, 2 * blocks))
    out = []
    poller = engine._poller
    assert poller is not None
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(jobs):
        job_id = poller._next_job_id
        t0 = time.perf_counter()
        await engine.load(ks, dst)
        t1 = time.perf_counter()
        out.append(since_submit(job_id, t0, t1))
    busy = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    return out, busy


def _baseline_latencies(handler: OffloadingHandler, jobs: int, spec: TransferSpec) -> list[float]:
    """Submit, then block in ``handler.wait`` (a CUDA event wait or a future wait, the GIL
    released, nothing spinning) without asyncio: t_detect - t_submit. A loop spinning on
    ``get_finished`` instead would hold the GIL and starve the handler's own threads."""
    out = []
    for job_id in range(10**9, 10**9 + jobs):
        t0 = time.perf_counter()
        handler.transfer_async(job_id, spec)
        handler.wait({job_id})
        done = handler.get_finished()
        assert any(r.job_id == job_id for r in done)
        out.append(time.perf_counter() - t0)
    return out


async def latency_deadline(jobs: int, delay_s: float, spin_s: float) -> Latency:
    handler = DeadlineHandler(delay_s)
    config = small_config(64)
    engine = OffloadEngine(
        config, spec=HandlerSpec(config, handler), kv_caches=CanonicalKVCaches([]),
        poll_spin_s=spin_s,
    )  # fmt: skip
    async with engine:
        lat, busy = await _engine_load_latencies(
            engine, jobs, lambda job, t0, t1: t1 - handler.done_at[job]
        )
    return Latency(f"deadline (spin {spin_s * 1e3:g} ms)", delay_s, lat, busy_cpu=busy)


async def latency_cuda(jobs: int, job_s: float, spin_s: float) -> Latency:
    import torch

    probe = CudaSleepHandler(1_000_000)
    probe.transfer_async(0, (None, None))  # type: ignore[arg-type]
    probe.stream.synchronize()
    (res,) = probe.get_finished()
    cycles = max(1, int(1_000_000 * job_s / res.transfer_time))  # type: ignore[operator]
    handler = CudaSleepHandler(cycles)
    spec = (CPULoadStoreSpec([0]), GPULoadStoreSpec([1], [1], [0]))
    _baseline_latencies(handler, 20, spec)  # warm-up
    gpu_times: dict[int, float] = {}

    def collect(results: list[TransferResult]) -> None:
        for r in results:
            gpu_times[r.job_id] = r.transfer_time or 0.0

    base = []
    for job_id in range(jobs):
        t0 = time.perf_counter()
        handler.transfer_async(job_id, spec)
        handler.wait({job_id})  # blocks on the stream without holding the GIL
        done = handler.get_finished()
        base.append(time.perf_counter() - t0 - (done[0].transfer_time or 0.0))
    config = small_config(64)
    engine = OffloadEngine(
        config, spec=HandlerSpec(config, handler), kv_caches=CanonicalKVCaches([]),
        poll_spin_s=spin_s,
    )  # fmt: skip
    original = handler.get_finished

    def spy() -> list[TransferResult]:
        results = original()
        collect(results)
        return results

    handler.get_finished = spy  # type: ignore[method-assign]
    async with engine:
        lat, busy = await _engine_load_latencies(
            engine, jobs, lambda job, t0, t1: t1 - t0 - gpu_times.get(job, 0.0)
        )
    torch.cuda.synchronize()
    return Latency(f"cuda event (spin {spin_s * 1e3:g} ms)", job_s, lat, base, busy)


class PairSpec(CPUOffloadingSpec):
    """The CPU manager plus a data-plane handler pair built from the KV caches."""

    def __init__(self, config: OffloadConfig, handlers_cls: Any) -> None:
        super().__init__(config, config.layout)
        self.handlers_cls = handlers_cls

    def get_handlers(
        self, kv_caches: CanonicalKVCaches
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        pair = self.handlers_cls(kv_caches, self.block_size_factor, self.num_blocks)
        yield GPULoadStoreSpec, CPULoadStoreSpec, pair.gpu_to_cpu_handler
        yield CPULoadStoreSpec, GPULoadStoreSpec, pair.cpu_to_gpu_handler


async def latency_real_backend(
    jobs: int, spin_s: float, device: str, blocks: int = 16, page: int = 256 * 1024
) -> Latency | None:
    """Loads of ``blocks`` x ``page`` bytes through the data plane's own handlers."""
    try:
        import torch

        if device == "cuda":
            from kvcache_offload.dataplane.handlers.cuda import CpuGpuOffloadingHandlers as pair_cls
        else:
            from kvcache_offload.dataplane.handlers.cpu_backend import (
                CpuBackendOffloadingHandlers as pair_cls,
            )
    except ImportError as exc:
        console.print(f"[yellow]{device} handlers not available ({exc}): skipped[/]")
        return None
    from kvcache_offload.contracts.kv_caches import (
        CanonicalKVCacheRef,
        CanonicalKVCacheTensor,
    )

    num_blocks = 4 * blocks
    tensor = torch.zeros((num_blocks, page), dtype=torch.int8, device=device)
    kv_caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(tensor, page)], [[CanonicalKVCacheRef(0, page)]]
    )
    config = OffloadConfig(
        cpu_bytes_to_use=num_blocks * page,
        layout=KVCacheLayout(gpu_block_sizes=[16], bytes_per_block=page, num_gpu_blocks=num_blocks),
        backend=device,
    )  # type: ignore[arg-type]
    spec = (CPULoadStoreSpec(list(range(blocks))), GPULoadStoreSpec(
        list(range(blocks, 2 * blocks)), [blocks], [0]
    ))  # fmt: skip
    pair = pair_cls(kv_caches, 1, num_blocks)
    # CUDA handlers finish on the device: only thread-pool handlers know the instant.
    exact = device == "cpu" and callable(
        getattr(pair.cpu_to_gpu_handler, "set_completion_callback", None)
    )
    done_at = [0.0]
    if exact:
        # The copy thread reports the completion instant itself: latencies are exact.
        # Baseline: a thread blocked on a threading.Event set by that callback.
        flag = threading.Event()

        def on_complete() -> None:
            done_at[0] = time.perf_counter()
            flag.set()

        load = pair.cpu_to_gpu_handler
        load.set_completion_callback(on_complete)
        base = []
        for job_id in range(jobs + 20):
            flag.clear()
            load.transfer_async(job_id, spec)
            flag.wait()
            t1 = time.perf_counter()
            load.get_finished()
            if job_id >= 20:
                base.append(t1 - done_at[0])
    else:
        # Baseline: the same handlers driven by a bare spin loop on get_finished, no asyncio.
        _baseline_latencies(pair.cpu_to_gpu_handler, 20, spec)
        base = _baseline_latencies(pair.cpu_to_gpu_handler, jobs, spec)
    pair.shutdown()
    engine = OffloadEngine(
        config, spec=PairSpec(config, pair_cls), kv_caches=kv_caches, poll_spin_s=spin_s
    )
    async with engine:
        if exact:
            assert engine.worker is not None and engine._poller is not None
            wake = engine._poller.wake_threadsafe
            load = engine.worker.transfer_type_to_handler[("CPU", "GPU")]

            def record_and_wake() -> None:
                done_at[0] = time.perf_counter()
                wake()

            load.set_completion_callback(record_and_wake)  # type: ignore[attr-defined]
            lat, busy = await _engine_load_latencies(
                engine, jobs, lambda job, t0, t1: t1 - done_at[0], blocks=blocks
            )
        else:
            lat, busy = await _engine_load_latencies(
                engine, jobs, lambda job, t0, t1: t1 - t0, blocks=blocks
            )
    size = blocks * page
    return Latency(
        f"{device} handlers {size >> 20} MiB load{' (exact)' if exact else ''} "
        f"(spin {spin_s * 1e3:g} ms)",
        0.0 if exact else pct(base, 50),
        lat,
        base,
        busy,
    )


# -- 2. idle CPU --------------------------------------------------------------------------------


async def idle_cpu(idle_s: float) -> dict[str, float]:
    handler = DeadlineHandler(0.0)
    config = small_config(64)
    engine = OffloadEngine(
        config, spec=HandlerSpec(config, handler), kv_caches=CanonicalKVCaches([])
    )
    async with engine:
        await engine.store([key_of(0)], [0])  # exercise poller, then go idle
        await engine.prepare_store([key_of(1)], ttl_s=3600)  # an open lease: reaper waits
        sub = engine.subscribe()  # a subscriber waiting for events
        reader = asyncio.create_task(sub.__anext__())
        await asyncio.sleep(0.1)
        polls0 = engine._poller.polls  # type: ignore[union-attr]
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await asyncio.sleep(idle_s)
        cpu1, wall1 = time.process_time(), time.perf_counter()
        polls = engine._poller.polls - polls0  # type: ignore[union-attr]
        reader.cancel()
        await sub.aclose()
    return {
        "idle_s": wall1 - wall0,
        "cpu_s": cpu1 - cpu0,
        "cpu_fraction_of_core": (cpu1 - cpu0) / (wall1 - wall0),
        "polls_while_idle": polls,
    }


# -- 3. lookup overhead -----------------------------------------------------------------------


def load_trace(path: Path | None, limit: int) -> tuple[list[list[OffloadKey]], str]:
    if path is not None and path.exists():
        reqs = []
        with path.open() as f:
            for line in f:
                if len(reqs) >= limit:
                    break
                ids = json.loads(line)["hash_ids"]
                reqs.append([make_offload_key(str(h).encode(), 0) for h in ids])
        return reqs, str(path)
    rng = np.random.default_rng(0)
    reqs, next_id, prefixes = [], 0, []
    for _ in range(limit):
        if prefixes and rng.random() < 0.6:
            base = prefixes[int(rng.integers(len(prefixes)))]
            ids = base[: int(rng.integers(1, len(base) + 1))]
        else:
            ids = []
        extra = int(rng.integers(1, 20))
        ids = [*ids, *range(next_id, next_id + extra)]
        next_id += extra
        prefixes.append(ids)
        reqs.append([make_offload_key(str(h).encode(), 0) for h in ids])
    return reqs, "generated"


def direct_prefix_lookup(
    manager: OffloadingManager, keys: Sequence[OffloadKey], ctx: ReqContext
) -> tuple[int, bool]:
    """vLLM's maximal prefix walk straight on the manager: the baseline."""
    hits = 0
    pending = False
    lookup = manager.lookup
    for key in keys:
        found = lookup(key, ctx)
        if found is False:
            break
        if found is None:
            pending = True
        hits += 1
    return hits, pending


def _replay_store(manager: OffloadingManager, keys: list[OffloadKey], ctx: ReqContext) -> None:
    out = manager.prepare_store(keys, ctx)
    if out is not None and out.keys_to_store:
        manager.complete_store(out.keys_to_store, ctx)


def direct_all_states(
    manager: OffloadingManager, keys: Sequence[OffloadKey], ctx: ReqContext
) -> tuple[int, bool]:
    """Every key's answer straight from the manager (what a full-state lookup must do)."""
    lookup = manager.lookup
    answers = [lookup(key, ctx) for key in keys]
    hits = 0
    for found in answers:
        if found is not True:
            break
        hits += 1
    return hits, None in answers


async def _replay_lookups(
    reqs: list[list[OffloadKey]], capacity: int, mode: str
) -> tuple[float, int]:
    """Seconds spent in lookups over the trace, and total hits; stores replayed untimed."""
    ctx = ReqContext()
    config = small_config(capacity)
    engine = OffloadEngine(config)
    manager = engine.manager
    spent = 0.0
    total_hits = 0
    perf = time.perf_counter
    async with engine:
        for keys in reqs:
            if mode == "direct_prefix":
                t0 = perf()
                hits, _ = direct_prefix_lookup(manager, keys, ctx)
                spent += perf() - t0
            elif mode == "direct_all":
                t0 = perf()
                hits, _ = direct_all_states(manager, keys, ctx)
                spent += perf() - t0
            else:
                t0 = perf()
                result = await engine.lookup(keys, ctx, prefix_only=mode == "engine_prefix")
                spent += perf() - t0
                hits = result.hits
            total_hits += hits
            _replay_store(manager, keys, ctx)
    return spent, total_hits


LOOKUP_MODES = ("direct_prefix", "engine_prefix", "direct_all", "engine_all")


async def lookup_overhead(
    reqs: list[list[OffloadKey]], capacity: int, rounds: int
) -> dict[str, Any]:
    best = dict.fromkeys(LOOKUP_MODES, float("inf"))
    hits: dict[str, int] = {}
    for _ in range(rounds):
        for mode in LOOKUP_MODES:  # interleaved so drifting machine load hits all modes
            spent, hits[mode] = await _replay_lookups(reqs, capacity, mode)
            best[mode] = min(best[mode], spent)
    n = len(reqs)
    return {
        "requests": n,
        "keys": sum(len(k) for k in reqs),
        "capacity_blocks": capacity,
        "hit_blocks": hits,
        "us_per_call": {mode: best[mode] / n * 1e6 for mode in LOOKUP_MODES},
        "ratio_prefix": best["engine_prefix"] / best["direct_prefix"],
        "ratio_all_states": best["engine_all"] / best["direct_all"],
        "ratio_all_states_vs_direct_prefix": best["engine_all"] / best["direct_prefix"],
    }


# -- driver -------------------------------------------------------------------------------------


def machine_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if device == "cuda":
            info["gpu"] = torch.cuda.get_device_name(0)
            info["cuda"] = torch.version.cuda
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        info["anyio"] = version("anyio")
    except Exception:
        pass
    return info


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    device = args.device
    if device == "auto":
        try:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            device = "cpu"
    results: dict[str, Any] = {"device": device}

    lats: list[Latency] = []
    for spin_s in args.spin_s:
        for delay in (0.0002, 0.001, 0.01):
            lats.append(await latency_deadline(args.jobs, delay, spin_s))
        for backend in ("cpu", "cuda") if device == "cuda" else ("cpu",):
            try:
                real = await latency_real_backend(args.jobs, spin_s, backend)
            except Exception as exc:  # a data-plane failure must not hide the other numbers
                console.print(f"[red]{backend} handlers failed: {exc!r}: skipped[/]")
                results.setdefault("errors", []).append(f"{backend} handlers: {exc!r}")
                real = None
            if real is not None:
                lats.append(real)
        if device == "cuda":
            for job_s in (0.0001, 0.001, 0.01):
                lats.append(await latency_cuda(args.jobs, job_s, spin_s))
    results["latency"] = [lat.row() for lat in lats]

    table = Table(title="completion -> awaiting coroutine resumed (us)")
    for col in (
        "path",
        "job us",
        "n",
        "p50",
        "p99",
        "base p50",
        "base p99",
        "added p50",
        "added p99",
    ):
        table.add_column(col, justify="right" if col != "path" else "left")
    for row in results["latency"]:
        table.add_row(
            row["name"], f"{row['job_us']:.0f}", str(row["n"]),
            f"{row['engine_p50_us']:.1f}", f"{row['engine_p99_us']:.1f}",
            *(
                f"{row[k]:.1f}" if k in row else "-"
                for k in ("baseline_p50_us", "baseline_p99_us", "added_p50_us", "added_p99_us")
            ),
            f"{row['busy_cpu_fraction'] * 100:.0f}",
        )  # fmt: skip
    console.print(table)

    idle = await idle_cpu(args.idle_s)
    results["idle"] = idle
    table = Table(title=f"idle engine over {idle['idle_s']:.1f} s")
    for col in ("cpu s", "% of a core", "polls while idle"):
        table.add_column(col, justify="right")
    table.add_row(
        f"{idle['cpu_s']:.4f}", f"{idle['cpu_fraction_of_core'] * 100:.3f}",
        str(idle["polls_while_idle"]),
    )  # fmt: skip
    console.print(table)

    reqs, source = load_trace(args.trace, args.requests)
    look = await lookup_overhead(reqs, args.capacity, args.rounds)
    look["trace"] = source
    results["lookup"] = look
    table = Table(title=f"lookup per call, {look['requests']} requests from {Path(source).name}")
    for col in ("walk", "direct manager us", "engine.lookup us", "ratio", "hit blocks"):
        table.add_column(col, justify="right" if col != "walk" else "left")
    per = look["us_per_call"]
    table.add_row(
        "prefix (stop at first absent)", f"{per['direct_prefix']:.2f}",
        f"{per['engine_prefix']:.2f}", f"{look['ratio_prefix']:.2f}x",
        str(look["hit_blocks"]["engine_prefix"]),
    )  # fmt: skip
    table.add_row(
        "every key's state", f"{per['direct_all']:.2f}", f"{per['engine_all']:.2f}",
        f"{look['ratio_all_states']:.2f}x", str(look["hit_blocks"]["engine_all"]),
    )  # fmt: skip
    console.print(table)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.aio", description=__doc__)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--jobs", type=int, default=1000, help="transfers per latency run")
    parser.add_argument(
        "--spin-s", type=float, nargs="+", default=[0.02], help="poller spin windows to try"
    )
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--requests", type=int, default=12_031)
    parser.add_argument("--capacity", type=int, default=20_000, help="CPU blocks for lookups")
    parser.add_argument("--rounds", type=int, default=3, help="best of N for lookups")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    results = asyncio.run(main_async(args))
    report = {
        "bench": "aio",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["python -m bench.aio", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine_info(results["device"]),
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"aio-{results['device']}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
