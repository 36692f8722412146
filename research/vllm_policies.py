"""Hit rates of vLLM 0.33's own CPU tier against this library's under the same manager calls.

    .venv-vllm/0.33.0/bin/python -m research.vllm_policies [--trace PATH]
        [--vllm-policies lru,arc] [--ours lru,adaptive] [--capacities 1%,2%,5%,10%,20%]

Needs vLLM 0.33 installed (``./scripts/vllm-tests.sh 0.33.0`` builds such a venv). Each request
of a Mooncake trace is replayed as vLLM 0.33's scheduler drives a manager: ``on_new_request``,
``lookup`` until the first miss, ``prepare_load`` / ``complete_load`` of the hits,
``prepare_store`` / ``complete_store`` of the rest, ``on_request_finished``, with each key's
end-token position recorded in the request's context as the scheduler records it. vLLM's
``CPUOffloadingManager`` gets these calls directly; ours gets them through the plug-in's
0.33 adapter logic (``integrations/vllm/_request_keys``, which replays 0.21's touches). What a
vLLM 0.33 deployment gains or loses by switching its spec by config. Prints block hit rates,
writes JSON under ``bench/out/``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

try:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VllmManager
except ImportError as exc:  # vLLM absent, or a release without this manager API
    raise SystemExit(
        f"research.vllm_policies needs vLLM 0.33 ({exc}); ./scripts/vllm-tests.sh 0.33.0 builds "
        ".venv-vllm/0.33.0, then run .venv-vllm/0.33.0/bin/python -m research.vllm_policies"
    ) from None

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.manager import CPUOffloadingManager
from kvcache_offload.lab.sweep import parse_capacities
from kvcache_offload.lab.trace import BLOCK_TOKENS, Trace, default_trace_paths, load_trace
from research._output import write_json
from research.vllm_touches import replay_as_vllm_033


def _context(index: int, keys: list[OffloadKey]) -> ReqContext:
    context = ReqContext(req_id=f"req-{index}")
    for position, key in enumerate(keys):
        context.set_offload_key_position(key, (position + 1) * BLOCK_TOKENS)
    return context


def replay_vllm(manager: Any, trace: Trace) -> int:
    """Hit blocks of vLLM's own manager under its scheduler's calls."""
    hits = 0
    for index, keys in enumerate(trace.keys):
        context = _context(index, keys)
        manager.on_new_request(context)
        h = 0
        for key in keys:
            if manager.lookup(key, context) is not LookupResult.HIT:
                break
            h += 1
        if h:
            manager.prepare_load(keys[:h], context)
            manager.complete_load(keys[:h], context)
        if h < len(keys):
            out = manager.prepare_store(keys[h:], context)
            if out is not None and out.keys_to_store:
                manager.complete_store(out.keys_to_store, context)
        manager.on_request_finished(context)
        hits += h
    return hits


def replay_ours(manager: CPUOffloadingManager, trace: Trace) -> int:
    """Hit blocks of our manager under the same calls, through the 0.33 adapter's logic
    (``research.vllm_touches``' replay: the adapter does not read key positions)."""
    return replay_as_vllm_033(manager, trace, "replayed")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m research.vllm_policies", description=__doc__)
    parser.add_argument("--trace", type=Path, action="append", default=None)
    parser.add_argument("--vllm-policies", default="lru,arc")
    parser.add_argument("--ours", default="lru,adaptive")
    parser.add_argument("--capacities", default="1%,2%,5%,10%,20%")
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    columns = [f"vLLM {p}" for p in args.vllm_policies.split(",")]
    columns += [f"ours {p}" for p in args.ours.split(",")]
    for path in args.trace or default_trace_paths():
        trace = load_trace(path)
        unique = len({k for keys in trace.keys for k in keys})
        total = trace.num_block_accesses
        for cap in parse_capacities(args.capacities):
            capacity = cap.blocks(unique)
            row: dict[str, Any] = {"trace": trace.name, "capacity": cap.label()}
            for policy in args.vllm_policies.split(","):
                hits = replay_vllm(VllmManager(capacity, cache_policy=policy), trace)
                row[f"vLLM {policy}"] = 100.0 * hits / total
            for policy in args.ours.split(","):
                hits = replay_ours(CPUOffloadingManager(capacity, policy), trace)
                row[f"ours {policy}"] = 100.0 * hits / total
            rows.append(row)
    table = Table(title="block hit % under vLLM 0.33's manager calls")
    for column in ("trace", "capacity", *columns):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["trace"], row["capacity"], *[f"{row[c]:.2f}" for c in columns])
    Console().print(table)
    out = {"rows": rows, "args": {**vars(args), "trace": [str(p) for p in args.trace or []]}}
    if not args.no_json:
        write_json("vllm_policies", out)
    return out


if __name__ == "__main__":
    main()
