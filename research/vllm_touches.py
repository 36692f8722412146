"""Hit rates under vLLM 0.33's manager calls, which never include ``touch``.

    python -m research.vllm_touches [--trace PATH] [--policies lru,adaptive]
                                 [--capacities 1%,2%,5%,10%,20%]

vLLM 0.21's scheduler touches each request's keys when it looks the request up and again
after every store; the lab's driver (``replay_trace``) makes those calls. vLLM 0.33's
scheduler makes none: it reports a request's end instead. This replays a trace with 0.33's
calls (lookups, a load of the hit prefix, a store of the rest, the request's end) three ways:

* ``none``: no touch at all (what vLLM 0.33 itself does);
* ``at end``: every key the request loaded or offered to store touched once at its end;
* ``replayed``: the plug-in's replay of 0.21's touches (``integrations/vllm/_request_keys``),

next to the 0.21 calls, and prints block hit rates; JSON under ``bench/out/``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.manager import CPUOffloadingManager
from kvcache_offload.integrations.vllm import _request_keys as request_keys
from kvcache_offload.lab.driver import replay_trace
from kvcache_offload.lab.sweep import parse_capacities
from kvcache_offload.lab.trace import Trace, default_trace_paths, load_trace
from research._output import write_json

MODES = ("none", "at end", "replayed")


@dataclass
class Context:
    """vLLM 0.33's ``ReqContext`` as far as the plug-in reads it (its scratch space)."""

    req_id: str
    _state: dict[type, Any] = field(default_factory=dict)

    def get_state(self, kind: type) -> Any:
        return self._state.get(kind)

    def set_state(self, value: Any) -> None:
        self._state[type(value)] = value


def replay_as_vllm_033(manager: CPUOffloadingManager, trace: Trace, mode: str) -> int:
    """Hit blocks of ``trace`` under 0.33's calls, touched as ``mode`` says."""

    def touch(keys: list[OffloadKey], context: Any) -> None:
        manager.touch(keys, context)

    hits = 0
    for index, keys in enumerate(trace.keys):
        context = Context(f"req-{index}")
        h = 0
        for key in keys:
            if manager.lookup(key, context) is not True:
                break
            h += 1
        if h:
            manager.prepare_load(keys[:h], context)
            if mode == "replayed":
                request_keys.loaded(context, keys[:h])
            manager.complete_load(keys[:h], context)
        if h < len(keys):
            tail = keys[h:]
            if mode == "replayed":
                out = request_keys.storing(
                    context, tail, touch, lambda t=tail, c=context: manager.prepare_store(t, c)
                )
            else:
                out = manager.prepare_store(tail, context)
            if out is not None and out.keys_to_store:
                manager.complete_store(out.keys_to_store, context)
        if mode == "replayed":
            request_keys.finished(context, touch)
        elif mode == "at end":
            manager.touch(keys, context)
        hits += h
    return hits


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m research.vllm_touches", description=__doc__)
    parser.add_argument("--trace", type=Path, action="append", default=None)
    parser.add_argument("--policies", default="lru,adaptive")
    parser.add_argument("--capacities", default="1%,2%,5%,10%,20%")
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for path in args.trace or default_trace_paths():
        trace = load_trace(path)
        unique = len({k for keys in trace.keys for k in keys})
        total = trace.num_block_accesses
        for cap in parse_capacities(args.capacities):
            capacity = cap.blocks(unique)
            for policy in args.policies.split(","):
                row: dict[str, Any] = {"trace": trace.name, "capacity": cap.label(),
                                       "policy": policy}  # fmt: skip
                counts = replay_trace(CPUOffloadingManager(capacity, policy), trace)
                row["0.21 calls"] = 100.0 * counts.block_hits / total
                for mode in MODES:
                    hits = replay_as_vllm_033(CPUOffloadingManager(capacity, policy), trace, mode)
                    row[mode] = 100.0 * hits / total
                rows.append(row)
    table = Table(title="block hit % under vLLM 0.33's calls (no touch) against 0.21's")
    for column in ("trace", "capacity", "policy", "0.21 calls", *MODES):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["trace"], row["capacity"], row["policy"],
                      *[f"{row[c]:.2f}" for c in ("0.21 calls", *MODES)])  # fmt: skip
    Console().print(table)
    out = {"rows": rows, "args": {**vars(args), "trace": [str(p) for p in args.trace or []]}}
    if not args.no_json:
        write_json("vllm_touches", out)
    return out


if __name__ == "__main__":
    main()
