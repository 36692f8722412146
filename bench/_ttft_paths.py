"""The paths of bench.ttft for one context length (see bench/ttft.py's docstring)."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from bench._handler_variants import handler_variant
from bench._ttft_model import forward, greedy, new_cache, sync
from kvcache_offload import make_offload_key
from kvcache_offload.aio import OffloadEngine
from kvcache_offload.config import KVCacheLayout, OffloadConfig
from kvcache_offload.integrations.transformers import PagedKV, wait_for_layers

GiB = 1024**3


class ContextRun:
    """One context length: the model's reference cache, the pages, the keys, the paths."""

    def __init__(
        self, model: Any, device: torch.device, context: int, args: argparse.Namespace, disk: Path
    ) -> None:
        self.model, self.device, self.context, self.args = model, device, context, args
        self.disk = disk / f"c{context}"
        gen = torch.Generator().manual_seed(context)
        vocab = model.config.vocab_size
        self.ctx_ids = torch.randint(0, vocab, (1, context), generator=gen).to(device)
        self.turn_ids = torch.randint(0, vocab, (1, args.turn), generator=gen).to(device)
        self.num_blocks = -(-context // 16)
        dtype = next(model.parameters()).dtype
        self.paged = PagedKV.for_model(model.config, self.num_blocks + 8, 16, device, dtype)
        for page in self.paged.pages:
            page.zero_()
        self.blocks = list(range(self.num_blocks))
        self.kv_bytes = self.num_blocks * self.paged.block_nbytes
        self.keys = []
        digest = hashlib.sha256(str(context).encode()).digest()
        for _ in range(self.num_blocks):
            digest = hashlib.sha256(digest).digest()
            self.keys.append(make_offload_key(digest[:16], 0))
        self.ref_cache: Any = None
        self.hit_tokens: list[int] = []
        self.hit_logits: torch.Tensor | None = None

    def config(self, **extra: Any) -> OffloadConfig:
        nbytes = self.paged.block_nbytes
        return OffloadConfig(
            cpu_bytes_to_use=(self.num_blocks + 64) * nbytes,
            layout=KVCacheLayout(
                gpu_block_sizes=[self.paged.block_size],
                bytes_per_block=nbytes,
                num_gpu_blocks=self.paged.pages[0].shape[1],
            ),
            **extra,
        )

    async def prepare(self) -> None:
        self.ref_cache = new_cache(self.model)
        forward(self.model, self.ctx_ids, self.ref_cache)
        self.paged.write(self.ref_cache, self.blocks, self.context)
        sync(self.device)

    def release(self) -> None:
        self.ref_cache = None
        self.paged.pages = []

    # -- helpers ----------------------------------------------------------------------------
    def _poison(self) -> None:
        for page in self.paged.pages:
            page[:, : self.num_blocks].fill_(-3 if page.is_floating_point() else 0)

    def _kv_equal(self) -> bool:
        views, _ = self.paged.layer_views(self.blocks, self.context)
        for layer, (k, v) in enumerate(views):
            ref = self.ref_cache.layers[layer]
            if not (
                torch.equal(k, ref.keys[..., : self.context, :])
                and torch.equal(v, ref.values[..., : self.context, :])
            ):
                return False
        return True

    async def _timed(
        self, step: Any, reps: int, before: Any = None
    ) -> tuple[float, list[float], Any]:
        times, result = [], None
        for i in range(reps + 1):
            if before is not None:
                await before()
            sync(self.device)
            start = time.perf_counter()
            result = await step()
            sync(self.device)
            if i:
                times.append(time.perf_counter() - start)
        ordered = sorted(times)
        return ordered[len(ordered) // 2], times, result

    def _row(self, path: str, seconds: float, times: list[float], **extra: Any) -> dict[str, Any]:
        return {
            "context": self.context, "path": path, "ttft_ms": seconds * 1e3,
            "times_ms": [t * 1e3 for t in times], "kv_bytes": self.kv_bytes, **extra,
        }  # fmt: skip

    # -- paths ------------------------------------------------------------------------------
    async def all_paths(
        self, mechanisms: list[str], floor: float, redis: str | None
    ) -> list[dict[str, Any]]:
        want = self.args.paths
        rows = []

        def selected(name: str) -> bool:
            return want == "all" or name in want.split(",")

        rec = await self.recompute() if selected("recompute") else None
        hit = await self.gpu_hit()
        if rec is not None:
            rec["agree"] = sum(
                a == b for a, b in zip(rec.pop("_tokens"), self.hit_tokens, strict=True)
            )
            rows.append(rec)
        rows.append(hit)
        if selected("restore"):
            for mechanism in mechanisms:
                rows.append(await self.restore(mechanism))
        if selected("layerwise"):
            rows.append(await self.restore("auto", layerwise=True))
        if selected("disk"):
            rows.append(await self.restore("auto", tier="disk"))
        if selected("redis"):
            if redis is None:
                rows.append({"context": self.context, "path": "redis",
                             "not_run": "no redis-server binary on this machine"})  # fmt: skip
            else:
                rows.append(await self.restore("auto", tier="redis", redis=redis))
        recompute_s = (rec or hit)["ttft_ms"] / 1e3
        hit_s = hit["ttft_ms"] / 1e3
        layers = self.paged.num_layers
        for r in rows:
            if r.get("not_run"):
                continue
            r["speedup"] = recompute_s / (r["ttft_ms"] / 1e3)
            r["floor_ms"] = floor * 1e3
            if r["path"].startswith("restore") or r["path"] in ("disk", "redis"):
                r["bound_ms"] = (floor + hit_s) * 1e3
            elif r["path"] == "layerwise":
                r["bound_ms"] = (max(floor, hit_s) + floor / layers) * 1e3
            if r.get("bound_ms"):
                r["of_bound"] = r["ttft_ms"] / r["bound_ms"]
            if r["path"] not in ("recompute", "gpu_hit"):
                r["tokens_equal"] = r.get("_tokens") == self.hit_tokens
                r["tokens"] = "equal" if r["tokens_equal"] else "DIFF"
            elif r["path"] == "recompute":
                r["tokens"] = f"{r['agree']}/{len(self.hit_tokens)}"
            r.pop("_tokens", None)
        return rows

    async def recompute(self) -> dict[str, Any]:
        ids = torch.cat([self.ctx_ids, self.turn_ids], dim=1)
        holder: dict[str, Any] = {}

        async def step() -> torch.Tensor:
            holder["cache"] = new_cache(self.model)
            return forward(self.model, ids, holder["cache"])

        seconds, times, logits = await self._timed(step, self.args.reps)
        tokens = greedy(self.model, holder["cache"], logits, self.args.decode)
        return self._row("recompute", seconds, times, _tokens=tokens)

    async def gpu_hit(self) -> dict[str, Any]:
        cache = self.ref_cache

        async def before() -> None:
            _crop_to(cache, self.context)

        async def step() -> torch.Tensor:
            return forward(self.model, self.turn_ids, cache)

        seconds, times, logits = await self._timed(step, self.args.reps, before)
        self.hit_logits = logits.clone()
        self.hit_tokens = greedy(self.model, cache, logits, self.args.decode)
        _crop_to(cache, self.context)
        return self._row("gpu_hit", seconds, times)

    async def restore(
        self, mechanism: str, layerwise: bool = False, tier: str | None = None,
        redis: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        extra: dict[str, Any] = {}
        if not mechanism.startswith("auto"):
            extra["transfer"] = {"mechanism": mechanism}
        server = None
        if tier == "disk":
            extra["disk_path"] = self.disk
            extra["disk_bytes"] = 2 * self.kv_bytes + GiB
        elif tier == "redis":
            assert redis is not None
            server, port = _start_redis(redis, 2 * self.kv_bytes + GiB)
            extra["remote_url"] = f"redis://127.0.0.1:{port}/0"
        try:
            with handler_variant(mechanism):
                engine = OffloadEngine(self.config(**extra), kv_caches=self.paged.kv_caches())
            async with engine:
                return await self._restore_with(engine, mechanism, layerwise, tier)
        finally:
            if server is not None:
                server.terminate()
                server.wait(10)

    async def _restore_with(
        self, engine: OffloadEngine, mechanism: str, layerwise: bool, tier: str | None
    ) -> dict[str, Any]:
        await engine.store(self.keys, self.blocks)
        if tier is not None:
            await _written_below(engine, len(self.keys))
        parts: dict[str, list[float]] = {"load": [], "rebuild": []}
        config = self.model.config
        layers = self.model.model.layers

        pending: list[Any] = []

        async def settle() -> None:
            # The first token does not wait for the pins' release: the load finishes here.
            while pending:
                await pending.pop().done()

        async def before() -> None:
            await settle()
            if tier is not None:
                await engine.discard(self.keys)
            self._poison()

        async def step() -> torch.Tensor:
            start = time.perf_counter()
            if layerwise:
                handle = await engine.load_layerwise(
                    self.keys, self.blocks, refs_per_layer=self.paged.refs_per_layer
                )
            else:
                await engine.load(self.keys, self.blocks)
            loaded = time.perf_counter()
            cache = self.paged.as_cache(self.blocks, self.context, config)
            parts["load"].append(loaded - start)
            parts["rebuild"].append(time.perf_counter() - loaded)
            if layerwise:
                remove = wait_for_layers(layers, handle)
                try:
                    logits = forward(self.model, self.turn_ids, cache)
                finally:
                    remove()
                pending.append(handle)
            else:
                logits = forward(self.model, self.turn_ids, cache)
            self._last_cache = cache
            return logits

        seconds, times, logits = await self._timed(step, self.args.reps, before)
        await settle()
        kv_equal = self._kv_equal()
        logits_equal = self.hit_logits is not None and torch.equal(logits, self.hit_logits)
        tokens = greedy(self.model, self._last_cache, logits, self.args.decode)
        name = "layerwise" if layerwise else (tier or f"restore ({mechanism})")
        stats = engine.stats()
        handlers = {}
        worker = engine.worker
        if worker is not None:
            load_handler = worker.transfer_type_to_handler.get(("CPU", "GPU"))
            by_mechanism = getattr(load_handler, "jobs_by_mechanism", None)
            if by_mechanism:
                handlers = {k: v for k, v in by_mechanism.items() if v}
        return self._row(
            name, seconds, times,
            load_ms=_median(parts["load"][1:]) * 1e3,
            rebuild_ms=_median(parts["rebuild"][1:]) * 1e3,
            kv_equal=kv_equal, logits_equal=logits_equal, _tokens=tokens,
            load_jobs_by_mechanism=handlers,
            tier_promoted_blocks=stats.tier_promoted_blocks,
        )  # fmt: skip


def _crop_to(cache: Any, tokens: int) -> None:
    extra = cache.get_seq_length() - tokens
    if extra > 0:
        cache.crop(-extra)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


async def _written_below(engine: OffloadEngine, n: int, timeout_s: float = 120.0) -> None:
    """Wait until the secondary tier holds the ``n`` blocks a write-through store queued."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        tiers = engine.stats().tiers
        if tiers and tiers[0].put_blocks >= n:
            return
        await asyncio.sleep(0.01)
    raise TimeoutError(f"the tier did not take {n} blocks in {timeout_s}s")


def _start_redis(binary: str, max_bytes: int) -> tuple[subprocess.Popen[bytes], int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--maxmemory", str(max_bytes), "--maxmemory-policy", "allkeys-lru"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return server, port
        except OSError:
            time.sleep(0.02)
    server.kill()
    raise RuntimeError("redis-server did not answer PING")
