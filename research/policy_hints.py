"""Session-end hints: what ``discard`` is worth when the serving engine says a session ended.

    python -m research.policy_hints [--trace PATH] [--policies lru,adaptive]
                                 [--capacities 1%,2%,5%,10%,20%,3%,7%,15%]
                                 [--delays-s 0,10,30,60,120] [--modes discard,release]
                                 [--scope stores|request]

No eviction policy can tell a finished conversation's blocks from a paused one's, and the
lab's dead-block oracle is worth more than any policy on the conversation trace
(``docs/policy-lab.md``). A serving engine knows when a session ends (the client closes it,
or it times out); ``OffloadEngine.discard`` / ``POST /v1/discard`` let it say so. This
replays a Mooncake trace through the real manager with the lab driver (``replay_trace``)
and, ``delay`` seconds of trace time after a conversation's last request, discards (or
releases) the keys that conversation's own stores returned: what a serving engine would
pass. With ``--scope request`` it names every key of the conversation's last request
instead, shared prefixes included: what the vLLM plug-in releases when that request carries
the hint. The trace has no session ids, so conversations are inferred: a request continues
the earlier request whose full blocks (all but its last, possibly partial, block) are the
longest prefix of its keys, at least ``--min-depth`` blocks deep (shallower shared prefixes
are system prompts, not a conversation). The hint knows only that no further request of that
chain comes; a key shared with another conversation is still discarded (a wrong hint costs a
miss, measured here), and a later request that restarts a chain below ``--min-depth`` counts
as a new conversation. Prints block hit rates and the share of the LRU -> Belady gap closed,
next to the same policy without hints, and writes JSON under ``bench/out/``.
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.manager import CPUOffloadingManager
from kvcache_offload.lab.belady import belady_hits
from kvcache_offload.lab.driver import replay_trace
from kvcache_offload.lab.sweep import parse_capacities
from kvcache_offload.lab.trace import Trace, default_trace_paths, load_trace
from research._output import write_json


def conversations(keys: Sequence[Sequence[OffloadKey]], min_depth: int = 2) -> list[int]:
    """Each request's conversation: the index of the conversation's first request."""
    ends: dict[tuple[int, OffloadKey], int] = {}
    out: list[int] = []
    for j, ks in enumerate(keys):
        parent = None
        for depth in range(len(ks) - 1, min_depth - 1, -1):
            parent = ends.get((depth, ks[depth - 1]))
            if parent is not None:
                break
        out.append(out[parent] if parent is not None else j)
        if len(ks) > 1:
            ends[(len(ks) - 1, ks[-2])] = j
    return out


def replay_with_hints(
    trace: Trace,
    policy: str,
    capacity: int,
    conv: list[int],
    delay_s: float | None,
    mode: str = "discard",
    scope: str = "stores",
) -> float:
    """Block hit rate (%) of ``policy``; ``delay_s`` None: no hints. ``mode``: the
    manager's ``discard`` (freed at once) or ``release`` (evicted first when room is
    needed, unless used again). ``scope``: the keys the conversation's stores returned
    (what an embedding server passes), or every key of its last request (``request``: what
    the vLLM plug-in releases when that request carries the hint, shared prefixes stored by
    other conversations included)."""
    manager = CPUOffloadingManager(capacity, policy)
    hint = manager.release if mode == "release" else manager.discard
    last = {c: j for j, c in enumerate(conv)}
    stored_by: dict[int, list[OffloadKey]] = collections.defaultdict(list)
    due: collections.deque[tuple[float, int]] = collections.deque()

    def before_request(j: int) -> None:
        now = trace.timestamps[j]
        while due and due[0][0] <= now:
            c = due.popleft()[1]
            keys = stored_by.pop(c, [])
            hint(list(trace.keys[last[c]]) if scope == "request" else keys)
        if delay_s is not None and last[conv[j]] == j:
            # Trace timestamps are milliseconds, sorted, so the queue stays in order. The
            # hint fires before a later request and names this request's stores too.
            due.append((now + delay_s * 1000.0, conv[j]))

    def on_stored(j: int, keys: list[OffloadKey]) -> None:
        stored_by[conv[j]].extend(keys)

    counts = replay_trace(  # the lab's call sequence, one touch per request
        manager, trace, touch_after_store=False, before_request=before_request,
        on_stored=on_stored,
    )  # fmt: skip
    return 100.0 * counts.block_hit_rate


def _default_trace() -> Path:
    paths = default_trace_paths()
    return next((p for p in paths if "conversation" in p.name), paths[0])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m research.policy_hints", description=__doc__)
    parser.add_argument("--trace", type=Path, default=None)
    parser.add_argument("--policies", default="lru,adaptive")
    parser.add_argument("--capacities", default="1%,2%,5%,10%,20%,3%,7%,15%")
    parser.add_argument("--delays-s", default="0,10,30,60,120")
    parser.add_argument("--min-depth", type=int, default=2)
    parser.add_argument(
        "--modes", default="discard,release", help="discard (free at once), release (evict first)"
    )
    parser.add_argument(
        "--scope",
        choices=("stores", "request"),
        default="stores",
        help="stores: the keys the conversation stored; request: every key of its last "
        "request (the vLLM plug-in's hint)",
    )
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args(argv)
    trace = load_trace(args.trace or _default_trace())
    unique = len({k for ks in trace.keys for k in ks})
    conv = conversations(trace.keys, args.min_depth)
    delays = [float(d) for d in args.delays_s.split(",") if d]
    policies = args.policies.split(",")
    rows: list[dict[str, Any]] = []
    for cap in parse_capacities(args.capacities):
        label, capacity = cap.label(), cap.blocks(unique)
        lru = replay_with_hints(trace, "lru", capacity, conv, None)
        belady = 100.0 * belady_hits(trace, capacity).block_hit_rate
        for policy in policies:
            none = lru if policy == "lru" else replay_with_hints(
                trace, policy, capacity, conv, None
            )  # fmt: skip
            for mode in args.modes.split(","):
                row: dict[str, Any] = {"capacity": label, "blocks": capacity, "policy": policy,
                                       "mode": mode, "lru": lru, "belady": belady,
                                       "none": none}  # fmt: skip
                for delay in delays:
                    row[f"{delay:g} s"] = replay_with_hints(
                        trace, policy, capacity, conv, delay, mode, args.scope
                    )
                rows.append(row)
    table = Table(title=f"{trace.name}: block hit % (share of the LRU -> Belady gap), "
                  f"session-end hints ({args.scope}); {len(set(conv))} conversations")  # fmt: skip
    for column in ("capacity", "policy", "hint", "Belady", "no hints",
                   *[f"{d:g} s" for d in delays]):  # fmt: skip
        table.add_column(column, justify="right")
    for row in rows:
        gap = row["belady"] - row["lru"]

        def cell(value: float, gap: float = gap, lru: float = row["lru"]) -> str:
            share = (value - lru) / gap * 100 if gap > 0 else 0.0
            return f"{value:.2f} ({share:+.0f}%)"

        table.add_row(row["capacity"], row["policy"], row["mode"], f"{row['belady']:.2f}",
                      cell(row["none"]),
                      *[cell(row[f"{d:g} s"]) for d in delays])  # fmt: skip
    Console().print(table)
    out = {"trace": trace.name, "conversations": len(set(conv)), "rows": rows, "args": vars(args)}
    out["args"]["trace"] = str(args.trace) if args.trace else None
    if not args.no_json:
        write_json("policy-hints", out)
    return out


if __name__ == "__main__":
    main()
