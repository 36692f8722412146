"""bench.ttft's concurrent section: many conversations return at once to a small GPU cache.

The conversations (bench/_ttft_trace.py) ended their previous turn with their context's KV
stored in the CPU tier (``engine.store`` from the paged cache). The paged GPU cache holds a
quarter of their KV (at least the largest context): the most recently active conversations
(shortest gap) that fit are still resident there; the others were evicted. All return at
t0. A path decides what happens to a conversation that is not resident:

* ``recompute``: prefill context + turn;
* ``restore``: wait for free GPU blocks (FIFO), ``await engine.load``, prefill the turn;
* ``layerwise``: the same with ``engine.load_layerwise``; the turn's forward waits per layer
  (layer-wise jobs share the copier's one stream, one thread on the CPU backend, so they copy
  in the order they were issued).

A recomputed conversation keeps its KV in the model's own cache, not in the pages, so it
waits for no GPU block: the comparison is generous to recompute.

Resident conversations prefill their turn over the pages in every path. One forward runs at
a time (on the loop thread, as in a serving engine's step); loads run concurrently in the
engine and a conversation's blocks are freed once its first token (the argmax of its logits,
read on the host) is out. TTFT is t0 to that token. Checked in the warm-up round (not timed):
every first-token logits vector against the GPU hit's (the turn over the KV computed in
place), and for a sample of conversations the restored KV bit for bit and ``--decode`` greedy
tokens. Prefill saved = context tokens not recomputed / the round's wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import time
from collections import deque
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench._handler_variants import handler_variant
from bench._ttft_model import forward, greedy, new_cache, sync
from bench._ttft_trace import Conversation, draw
from kvcache_offload import make_offload_key
from kvcache_offload.aio import OffloadEngine
from kvcache_offload.config import KVCacheLayout, OffloadConfig
from kvcache_offload.integrations.transformers import PagedKV, wait_for_layers
from kvcache_offload.lab.trace import sample_trace_path

BLOCK = 16


async def concurrent_section(
    model: Any, device: torch.device, args: argparse.Namespace
) -> dict[str, Any]:
    """The section's JSON: the conversations drawn, the cache's size and one row per path."""
    trace = Path(getattr(args, "trace", None) or sample_trace_path())
    max_context = getattr(args, "max_context", None) or (512 if args.tiny else 32768)
    max_turn = getattr(args, "max_turn", None) or (32 if args.tiny else 2048)
    seed = getattr(args, "seed", 0)
    convs = draw(trace, args.concurrent, seed, args.tiny, max_context, max_turn)
    run = ConcurrentRun(model, device, convs, args)
    rows = await run.run(args.mechanisms.split(","))
    return {
        "trace": trace.name, "seed": seed, "block_tokens": BLOCK,
        "capacity_blocks": run.capacity, "total_blocks": run.total_blocks,
        "kv_bytes": run.total_blocks * run.paged.block_nbytes,
        "conversations": [
            vars(c) | {"resident": r.resident} for c, r in zip(convs, run.convs, strict=True)
        ],
        "rows": rows,
    }  # fmt: skip


class _Blocks:
    """Free GPU blocks, handed out first come first served (lowest ids, so runs stay
    contiguous and the cache is a view of the pages)."""

    def __init__(self, n: int) -> None:
        self.free = list(range(n))
        self._waiting: deque[tuple[int, asyncio.Future[list[int]]]] = deque()

    async def take(self, n: int) -> list[int]:
        if not self._waiting and len(self.free) >= n:
            return self._grab(n)
        fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._waiting.append((n, fut))
        return await fut

    def give(self, blocks: list[int]) -> None:
        self.free = sorted(self.free + blocks)
        while self._waiting and len(self.free) >= self._waiting[0][0]:
            n, fut = self._waiting.popleft()
            fut.set_result(self._grab(n))

    def _grab(self, n: int) -> list[int]:
        for start in range(len(self.free) - n + 1):
            if self.free[start + n - 1] - self.free[start] == n - 1:
                run = self.free[start : start + n]
                del self.free[start : start + n]
                return run
        taken, self.free = self.free[:n], self.free[n:]
        return taken


class _Conv:
    """One conversation's ids, keys and references."""

    def __init__(self, conv: Conversation, vocab: int, device: torch.device) -> None:
        self.conv = conv
        gen = torch.Generator().manual_seed(conv.index)
        self.ctx_ids = torch.randint(0, vocab, (1, conv.context), generator=gen).to(device)
        self.turn_ids = torch.randint(0, vocab, (1, conv.turn), generator=gen).to(device)
        self.num_blocks = -(-conv.context // BLOCK)
        digest = hashlib.sha256(f"conversation {conv.index}".encode()).digest()
        self.keys = []
        for _ in range(self.num_blocks):
            digest = hashlib.sha256(digest).digest()
            self.keys.append(make_offload_key(digest[:16], 0))
        self.resident = False
        self.hit_logits: torch.Tensor | None = None
        self.ref_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.hit_tokens: list[int] = []


class ConcurrentRun:
    """The concurrent section for one set of conversations (see the module docstring)."""

    def __init__(
        self, model: Any, device: torch.device, convs: list[Conversation], args: argparse.Namespace
    ) -> None:
        self.model, self.device, self.args = model, device, args
        self.convs = [_Conv(c, model.config.vocab_size, device) for c in convs]
        self.total_blocks = sum(c.num_blocks for c in self.convs)
        self.capacity = max(-(-self.total_blocks // 4), max(c.num_blocks for c in self.convs))
        dtype = next(model.parameters()).dtype
        self.paged = PagedKV.for_model(model.config, self.capacity, BLOCK, device, dtype)
        every = 1 if args.tiny else max(1, len(convs) // 4)
        self.sample = set(range(0, len(convs), every))
        used = 0
        for c in sorted(self.convs, key=lambda c: c.conv.gap_s):
            if used + c.num_blocks <= self.capacity:
                c.resident, used = True, used + c.num_blocks

    def _engine(self, mechanism: str) -> OffloadEngine:
        nbytes = self.paged.block_nbytes
        extra: dict[str, Any] = {}
        if not mechanism.startswith("auto"):
            extra["transfer"] = {"mechanism": mechanism}
        config = OffloadConfig(
            cpu_bytes_to_use=(self.total_blocks + 64) * nbytes,
            layout=KVCacheLayout(
                gpu_block_sizes=[BLOCK], bytes_per_block=nbytes, num_gpu_blocks=self.capacity
            ),
            **extra,
        )
        with handler_variant(mechanism):
            return OffloadEngine(config, kv_caches=self.paged.kv_caches())

    async def _store_all(self, engine: OffloadEngine) -> None:
        """Each conversation's previous turn: its context's KV computed, written to the pages
        and stored in the CPU tier; the GPU hit's references the first time."""
        for i, c in enumerate(self.convs):
            ref = new_cache(self.model)
            forward(self.model, c.ctx_ids, ref)
            blocks = list(range(c.num_blocks))
            self.paged.write(ref, blocks, c.conv.context)
            await engine.store(c.keys, blocks)
            if c.hit_logits is None:
                if i in self.sample:
                    c.ref_kv = [
                        (layer.keys.cpu().clone(), layer.values.cpu().clone())
                        for layer in ref.layers
                    ]
                c.hit_logits = forward(self.model, c.turn_ids, ref).clone()
                if i in self.sample:
                    c.hit_tokens = greedy(self.model, ref, c.hit_logits, self.args.decode)
            sync(self.device)

    async def run(self, mechanisms: list[str]) -> list[dict[str, Any]]:
        want = self.args.paths
        paths = [p for p in ("recompute", "restore", "layerwise") if want == "all" or p in want]
        rows = []
        for m, mechanism in enumerate(mechanisms):
            engine = self._engine(mechanism)
            async with engine:
                await self._store_all(engine)
                for path in paths:
                    if path == "restore" or m == 0:
                        name = f"restore ({mechanism})" if path == "restore" else path
                        rows.append(await self._path(engine, path, name))
        return rows

    async def _setup_round(self, engine: OffloadEngine, blocks: _Blocks) -> dict[int, list[int]]:
        """Resident conversations' KV back in the pages (untimed); every other block poisoned."""
        held = {}
        for i, c in enumerate(self.convs):
            if c.resident:
                held[i] = await blocks.take(c.num_blocks)
                await engine.load(c.keys, held[i])
        free = torch.as_tensor(blocks.free, dtype=torch.long, device=self.device)
        for page in self.paged.pages:
            page.index_fill_(1, free, -3)
        sync(self.device)
        return held

    async def _path(self, engine: OffloadEngine, path: str, name: str) -> dict[str, Any]:
        ttfts: list[float] = []
        walls: list[float] = []
        checks: dict[str, Any] = {}
        for rep in range(self.args.reps + 1):
            blocks = _Blocks(self.capacity)
            held = await self._setup_round(engine, blocks)
            check = rep == 0
            round_checks: dict[str, Any] = {
                "logits": {}, "kv": {}, "caches": {}, "first": {}, "loaded_bytes": 0, "gathered": 0
            }  # fmt: skip
            t0 = time.perf_counter()
            times = await asyncio.gather(
                *(
                    self._serve(engine, path, i, blocks, held.get(i), t0, check, round_checks)
                    for i in range(len(self.convs))
                )
            )
            wall = max(times)
            if check:
                checks = self._verify(round_checks)
            else:
                ttfts.extend(times)
                walls.append(wall)
        saved = sum(
            c.conv.context for c in self.convs if path != "recompute" or c.resident
        )  # fmt: skip
        wall_s = sorted(walls)[len(walls) // 2]
        ordered = sorted(ttfts)
        return {
            "path": name, "conversations": len(self.convs),
            "resident": sum(c.resident for c in self.convs),
            "ttft_p50_ms": _rank(ordered, 0.50) * 1e3, "ttft_p99_ms": _rank(ordered, 0.99) * 1e3,
            "ttfts_ms": [t * 1e3 for t in ttfts], "wall_ms": wall_s * 1e3,
            "saved_tokens": saved, "saved_tokens_per_s": saved / wall_s,
            "restore_bytes": 0 if path == "recompute" else self._miss_bytes(), **checks,
        }  # fmt: skip

    async def _serve(
        self, engine: OffloadEngine, path: str, i: int, blocks: _Blocks,
        mine: list[int] | None, t0: float, check: bool, out: dict[str, Any],
    ) -> float:  # fmt: skip
        c = self.convs[i]
        handle = None
        if mine is None and path == "recompute":
            cache = new_cache(self.model)
            logits = forward(self.model, torch.cat([c.ctx_ids, c.turn_ids], dim=1), cache)
        else:
            if mine is None:
                mine = await blocks.take(c.num_blocks)
                if path == "layerwise":
                    handle = await engine.load_layerwise(
                        c.keys, mine, refs_per_layer=self.paged.refs_per_layer
                    )
                else:
                    loaded = await engine.load(c.keys, mine)
                    out["loaded_bytes"] += loaded.transfer_bytes
            cache = self.paged.as_cache(mine, c.conv.context, self.model.config)
            if check and any(b != mine[0] + k for k, b in enumerate(mine)):
                out["gathered"] += 1
            remove = None
            if handle is not None:
                # Scattered blocks give a gathered cache, taken before the copy: gather each
                # layer again once it is in.
                scattered = any(b != mine[0] + k for k, b in enumerate(mine))
                after = partial(self.paged.refresh_layer, cache, block_ids=mine,
                                num_tokens=c.conv.context) if scattered else None  # fmt: skip
                remove = wait_for_layers(self.model.model.layers, handle, after)
            try:
                logits = forward(self.model, c.turn_ids, cache)
            finally:
                if remove is not None:
                    remove()
        out["first"][i] = int(logits.argmax())
        ttft = time.perf_counter() - t0
        if check:
            out["logits"][i] = torch.equal(logits, c.hit_logits)
            if i in self.sample:
                out["caches"][i] = (cache, logits.clone())
                if mine is not None:
                    out["kv"][i] = self._kv_equal(c, mine)
        if handle is not None:
            done = await handle.done()
            out["loaded_bytes"] += done.transfer_bytes
        if mine is not None:
            blocks.give(mine)
        return ttft

    def _miss_bytes(self) -> int:
        """Bytes a round restores from the CPU tier: every non-resident context."""
        return sum(c.num_blocks for c in self.convs if not c.resident) * self.paged.block_nbytes

    def _kv_equal(self, c: _Conv, mine: list[int]) -> bool:
        assert c.ref_kv is not None
        views, _ = self.paged.layer_views(mine, c.conv.context)
        n = c.conv.context
        return all(
            torch.equal(k.cpu(), rk[..., :n, :]) and torch.equal(v.cpu(), rv[..., :n, :])
            for (k, v), (rk, rv) in zip(views, c.ref_kv, strict=True)
        )

    def _verify(self, got: dict[str, Any]) -> dict[str, Any]:
        """The warm-up round's checks (see the module docstring)."""
        tokens_equal = 0
        for i, (cache, logits) in got["caches"].items():
            tokens = greedy(self.model, cache, logits, self.args.decode)
            tokens_equal += tokens == self.convs[i].hit_tokens
        first_agree = sum(
            got["first"][i] == int(c.hit_logits.argmax()) for i, c in enumerate(self.convs)
        )  # fmt: skip
        return {
            "logits_equal": sum(got["logits"].values()),
            "first_tokens_agree": first_agree,
            "checked": len(got["caches"]), "tokens_equal": tokens_equal,
            "kv_checked": len(got["kv"]), "kv_equal": sum(got["kv"].values()),
            "loaded_bytes": got["loaded_bytes"], "gathered": got["gathered"],
        }  # fmt: skip


def _rank(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of a sorted list."""
    if not ordered:
        return 0.0
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
