"""Time to first token of a returning conversation: KV restored by the engine vs recomputed.

A Llama (Llama-3.1-8B's shape, random bf16 weights, SDPA, on the GPU; ``--tiny``: a tiny
Llama on the CPU backend) has seen a context of C tokens; a new turn of ``--turn`` tokens
arrives. Paths, each timed from the turn's arrival to its first token's logits:

1. ``recompute``: prefill context + turn;
2. ``gpu_hit``: the context's KV is still on the GPU: prefill the turn only;
3. ``restore``: ``await engine.load`` of the context's blocks (stored with
   ``engine.store`` from the paged cache), the cache viewed from the pages, then the turn;
4. ``layerwise``: ``engine.load_layerwise``; each decoder layer's forward waits (a stream
   wait) on its layer's copy;
5. ``disk`` / ``redis``: like 3 with the CPU tier emptied (``discard``): the load promotes
   the blocks from the disk tier (or Redis, when a ``redis-server`` binary exists).

Correctness, checked: restored KV equals the stored KV bit for bit, and greedy decoding of
the next ``--decode`` tokens equals path 2's. Reported: agreement with path 1 (one prefill of
everything may round differently in bf16). Bounds measured in the same run: the copy floor
(one bare pinned copy of the KV bytes); path 3's bound = floor + path 2; path 4's =
max(floor, path 2) + one layer's share of the floor. Prints a table, writes JSON.

``--concurrent N`` adds the section "beyond one request" (bench/_ttft_concurrent.py): N
conversations drawn from the shipped Mooncake conversation trace (contexts, new turns and
turn gaps; ``--trace`` for another file) return at once to a paged GPU cache that holds a
quarter of their KV; per path (recompute, restore, layer-wise) TTFT p50 / p99 and the prefill
tokens per second saved. ``--tiny`` scales the trace's token counts by 1/32.

    python -m bench.ttft [--tiny] [--contexts 2048,8192,32768|none] [--mechanisms auto,kernel]
                         [--concurrent 16 [--trace PATH] [--seed 0]]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench._common import write_json
from bench._ttft_concurrent import concurrent_section
from bench._ttft_model import build_model, copy_floor, sync
from bench._ttft_paths import ContextRun

DEFAULT_CONTEXTS = "2048,8192,32768"


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'context':>8} {'path':<16} {'TTFT ms':>9} {'x recompute':>11} {'/ bound':>8} "
        f"{'load ms':>8} {'rebuild ms':>10} {'tokens':>7} {'KV':>5}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        bound = f"{r['of_bound']:.2f}" if r.get("of_bound") else "-"
        load = f"{r['load_ms']:.2f}" if r.get("load_ms") is not None else "-"
        rebuild = f"{r['rebuild_ms']:.3f}" if r.get("rebuild_ms") is not None else "-"
        tokens = r.get("tokens", "-")
        kv = {True: "equal", False: "DIFF", None: "-"}[r.get("kv_equal")]
        if r.get("not_run"):
            lines.append(f"{r['context']:>8} {r['path']:<16} not run: {r['not_run']}")
            continue
        lines.append(
            f"{r['context']:>8} {r['path']:<16} {r['ttft_ms']:>9.2f} "
            f"{r['speedup']:>10.2f}x {bound:>8} {load:>8} {rebuild:>10} {tokens:>7} {kv:>5}"
        )
    return "\n".join(lines)


def _concurrent_table(section: dict[str, Any]) -> str:
    head = (
        f"{'path':<16} {'p50 ms':>8} {'p99 ms':>8} {'wall ms':>8} {'saved tok/s':>12} "
        f"{'logits':>7} {'tokens':>7} {'KV':>7}"
    )
    n = len(section["conversations"])
    resident = sum(c["resident"] for c in section["conversations"])
    lines = [
        f"{n} conversations return at once; GPU cache {section['capacity_blocks']} of "
        f"{section['total_blocks']} blocks; {resident} resident",
        head,
        "-" * len(head),
    ]
    for r in section["rows"]:
        lines.append(
            f"{r['path']:<16} {r['ttft_p50_ms']:>8.2f} {r['ttft_p99_ms']:>8.2f} "
            f"{r['wall_ms']:>8.2f} {r['saved_tokens_per_s']:>12.0f} "
            f"{r['logits_equal']:>3}/{n:<3} {r['tokens_equal']:>3}/{r['checked']:<3} "
            f"{r['kv_equal']:>3}/{r['kv_checked']:<3}"
        )
    return "\n".join(lines)


def _concurrent_failures(section: dict[str, Any]) -> list[str]:
    n = len(section["conversations"])
    return [
        r["path"]
        for r in section["rows"]
        if r["kv_equal"] != r["kv_checked"]
        or r["loaded_bytes"] != r["restore_bytes"]
        or (
            r["path"] != "recompute"
            and (r["logits_equal"] != n or r["tokens_equal"] != r["checked"])
        )
    ]


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cpu" if args.tiny else "cuda")
    model = build_model(args.tiny, device)
    contexts = [] if args.contexts == "none" else [int(c) for c in args.contexts.split(",")]
    mechanisms = args.mechanisms.split(",")
    redis = shutil.which("redis-server")
    rows: list[dict[str, Any]] = []
    floors: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="ttft-disk-") as disk_dir:
        for context in contexts:
            run = ContextRun(model, device, context, args, Path(disk_dir))
            await run.prepare()
            floor = copy_floor(run.kv_bytes, device, args.reps)
            floors[context] = floor
            rows.extend(await run.all_paths(mechanisms, floor, redis))
            run.release()
            sync(device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    result: dict[str, Any] = {
        "rows": rows, "floors_ms": {c: f * 1e3 for c, f in floors.items()}
    }  # fmt: skip
    if getattr(args, "concurrent", 0):
        result["concurrent"] = await concurrent_section(model, device, args)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny Llama on the CPU backend (CI)")
    p.add_argument("--contexts", default=None, help=f"default {DEFAULT_CONTEXTS}; tiny 64,256")
    p.add_argument("--turn", type=int, default=None, help="new-turn tokens (default 256; tiny 16)")
    p.add_argument("--decode", type=int, default=None, help="greedy tokens checked (32; tiny 8)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (5; tiny 2)")
    p.add_argument(
        "--mechanisms", default="auto", help="transfer.mechanism of path 3's engines (auto,...)"
    )
    p.add_argument("--paths", default="all", help="subset: recompute,gpu_hit,restore,...")
    p.add_argument("--concurrent", type=int, default=0, help="conversations returning at once")
    p.add_argument("--trace", default=None, help="Mooncake trace (default: the shipped sample)")
    p.add_argument("--seed", type=int, default=0, help="which conversations are drawn")
    p.add_argument("--max-context", type=int, default=None, help="cap (32768; tiny 512)")
    p.add_argument("--max-turn", type=int, default=None, help="cap (2048; tiny 32)")
    p.add_argument("--no-json", action="store_true")
    args = p.parse_args(argv)
    tiny = args.tiny
    args.contexts = args.contexts or ("64,256" if tiny else DEFAULT_CONTEXTS)
    args.turn = args.turn or (16 if tiny else 256)
    args.decode = args.decode or (8 if tiny else 32)
    args.reps = args.reps or (2 if tiny else 5)
    if not tiny and not torch.cuda.is_available():
        p.error("no CUDA device: use --tiny for the CPU configuration")
    if args.concurrent < 0 or args.concurrent == 1:
        p.error("--concurrent takes 0 (off) or at least 2 conversations")
    if args.contexts == "none" and not args.concurrent:
        p.error("--contexts none leaves nothing to run without --concurrent")
    result = asyncio.run(_run(args))
    device = "cpu (tiny Llama, CPU backend)" if tiny else torch.cuda.get_device_name(0)
    print(f"device: {device}; turn {args.turn} tokens; greedy tokens checked: {args.decode}")
    if result["rows"]:
        print(_table(result["rows"]))
    failures = [
        (r["context"], r["path"])
        for r in result["rows"]
        if r.get("kv_equal") is False or r.get("tokens_equal") is False
    ]
    if "concurrent" in result:
        print(_concurrent_table(result["concurrent"]))
        failures += [("concurrent", p) for p in _concurrent_failures(result["concurrent"])]
    if not args.no_json:
        path = write_json(
            "ttft",
            {
                "device": device,
                "versions": {"torch": torch.__version__, "transformers": _tf_version()},
                "settings": {
                    k: getattr(args, k)
                    for k in ("tiny", "contexts", "turn", "decode", "reps", "concurrent", "seed")
                }
                | {"mechanisms": args.mechanisms},
                **result,
            },
        )
        print(f"wrote {path}")
    if failures:
        print(f"CORRECTNESS FAILURES: {failures}")
        return 1
    return 0


def _tf_version() -> str | None:
    try:
        import transformers

        return str(transformers.__version__)
    except ImportError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
