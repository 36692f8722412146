"""How well online features predict whether a stored suffix comes back .

    python -m research.policy_features

For every request of each shipped trace, the blocks no earlier request used (the request's
new suffix, what any cache would have to store) either come back in a later request or not.
This prints, per feature bucket, how many new suffixes there were and the share of them that
came back (the first new block is used again later), and per distance from the request's end
the share of new *blocks* that came back. A dead-block admission predictor can only separate
what these shares separate. Features, all known when the suffix is stored:

* ``turn``: earlier requests of the request's document (its first block with fewer than two
  distinct children so far, as ``research.policy_candidates``' document candidates use);
* ``gap``: requests since the document's previous request (``-`` for a first request), /250;
* ``new``: length of the new suffix in blocks, /4; ``len``: the request's length, /8;
* ``seen``: the request's blocks seen before the new suffix (its known prefix), /4;
* ``from_end``: a new block's distance from the request's last block (0 = the last block);
* ``out``: the request's output length in tokens, /128 (known when the
  request ends, shortly after its prompt's blocks were stored: a hint a scheduler could
  give, not something the cache sees today);
* ``secs``: seconds since the document's previous request (``-`` for a first request),
  in powers of two (0: under a second, 1: under two, ..., 10: 512 s and more).

The last tenth of a trace undercounts returns (their next request may lie past the end).
Writes ``bench/out/policy-features-*.json``.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from typing import Any

from kvcache_offload.lab.trace import default_trace_paths, load_trace
from research._output import write_json
from research.policy_candidates import _doc_of


def _odds(
    block_ids: list[list[int]], output_lengths: list[int], timestamps_ms: list[float]
) -> dict[str, dict[str, list[int]]]:
    last: dict[int, int] = {}
    for i, keys in enumerate(block_ids):
        for k in keys:
            last[k] = i
    seen: set[int] = set()
    children: dict[int, set[int]] = {}
    turns: dict[int, int] = {}
    previous: dict[int, int] = {}
    previous_ms: dict[int, float] = {}
    table: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for i, keys in enumerate(block_ids):
        doc = _doc_of(keys, children)
        turn = turns.get(doc, 0)
        turns[doc] = turn + 1
        gap = "-" if doc not in previous else str(min(i - previous[doc], 3000) // 250)
        previous[doc] = i
        now_ms = timestamps_ms[i]
        secs = "-"
        if doc in previous_ms:
            secs = str(min(max(int(now_ms - previous_ms[doc]) // 1000, 0).bit_length(), 10))
        previous_ms[doc] = now_ms
        known = 0
        while known < len(keys) and keys[known] in seen:
            known += 1
        new = [j for j in range(known, len(keys)) if keys[j] not in seen]
        seen.update(keys)
        if not new:
            continue
        back = last[keys[new[0]]] > i
        buckets = {
            "turn": str(min(turn, 6)),
            "gap": gap,
            "new": str(min(len(new), 40) // 4),
            "len": str(min(len(keys), 80) // 8),
            "seen": str(min(known, 40) // 4),
            "out": str(min(output_lengths[i], 1024) // 128),
            "secs": secs,
        }
        for feature, bucket in buckets.items():
            cell = table[feature][bucket]
            cell[0] += 1
            cell[1] += back
        for j in new:
            cell = table["from_end"][str(min(len(keys) - 1 - j, 3))]
            cell[0] += 1
            cell[1] += last[keys[j]] > i
    return {f: dict(b) for f, b in table.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m research.policy_features", description=__doc__)
    parser.parse_args(argv)
    result: dict[str, Any] = {}
    for path in default_trace_paths():
        trace = load_trace(path)
        name = trace.name.removeprefix("mooncake_").split("_")[0]
        table = _odds(trace.block_ids, trace.output_lengths, trace.timestamps)
        result[name] = table
        for feature, buckets in table.items():
            order = sorted(buckets, key=lambda b: (b != "-", int(b) if b != "-" else 0))
            cells = " ".join(
                f"{b}:{buckets[b][1] / buckets[b][0]:.2f}({buckets[b][0]})" for b in order
            )
            print(f"{name} {feature}: {cells}", flush=True)
    write_json("policy-features", result)
    return result


if __name__ == "__main__":
    main()
