"""A small, seeded Mooncake-format trace with realistic prefix sharing, for tests and demos.

The generator mimics the structure of the Mooncake chat traces without copying them: a few
shared system prompts with skewed popularity, multi-turn conversations whose next prompt
extends the previous one (prompt + answer + new user text), and one-off requests. Hash ids
are chained as in vLLM: a block id stands for its whole prefix, and the partial last block of
a prompt gets a fresh id once the next turn fills it.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

from kvcache_offload.lab.trace import BLOCK_TOKENS

__all__ = ["synth_requests", "write_synth_trace"]


def synth_requests(
    num_requests: int = 500,
    seed: int = 0,
    num_system_prompts: int = 8,
    continue_prob: float = 0.6,
    mean_gap_ms: float = 200.0,
) -> list[dict[str, Any]]:
    """Return ``num_requests`` Mooncake-style records (dicts), deterministic for ``seed``."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    rng = random.Random(seed)
    next_id = 0

    def fresh(count: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + count))
        next_id += count
        return ids

    # System prompts: full blocks only, so every conversation shares them exactly.
    systems = [fresh(rng.randint(1, 6)) for _ in range(num_system_prompts)]
    weights = [1.0 / (rank + 1) ** 1.2 for rank in range(num_system_prompts)]
    # Open conversations: (full-block ids so far, tokens so far)
    conversations: list[tuple[list[int], int]] = []
    records: list[dict[str, Any]] = []
    ts = 0.0
    for _ in range(num_requests):
        ts += rng.expovariate(1.0 / mean_gap_ms)
        new_tokens = int(rng.lognormvariate(6.5, 1.0)) + 1
        if conversations and rng.random() < continue_prob:
            index = rng.randrange(len(conversations))
            full_ids, tokens = conversations[index]
            answer = int(rng.lognormvariate(5.5, 0.8)) + 1
            tokens += answer
        else:
            index = -1
            system = rng.choices(systems, weights)[0]
            full_ids, tokens = list(system), len(system) * BLOCK_TOKENS
        input_length = tokens + new_tokens
        num_blocks = -(-input_length // BLOCK_TOKENS)
        num_full = input_length // BLOCK_TOKENS
        # Blocks already full keep their ids; the rest (including a partial last one) are new.
        keep = full_ids[: min(len(full_ids), num_full)]
        hash_ids = keep + fresh(num_blocks - len(keep))
        records.append(
            {
                "timestamp": int(ts),
                "input_length": input_length,
                "output_length": int(rng.lognormvariate(5.5, 0.8)) + 1,
                "hash_ids": hash_ids,
            }
        )
        state = (hash_ids[:num_full], input_length)
        if index >= 0:
            conversations[index] = state
        elif rng.random() < 0.7:
            conversations.append(state)
            if len(conversations) > 64:
                conversations.pop(rng.randrange(len(conversations)))
    return records


def write_synth_trace(path: str | os.PathLike[str], **kwargs: Any) -> int:
    """Write :func:`synth_requests` as JSONL; returns the number of lines written."""
    records = synth_requests(**kwargs)
    with open(path, "w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(record) + "\n")
    return len(records)


def main(argv: list[str] | None = None) -> None:
    """``python -m kvcache_offload.lab.synth OUT.jsonl [--requests N] [--seed S]``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m kvcache_offload.lab.synth",
        description="Write a small seeded Mooncake-format trace with prefix sharing.",
    )
    parser.add_argument("out", help="output JSONL path")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    count = write_synth_trace(args.out, num_requests=args.requests, seed=args.seed)
    print(f"wrote {count} requests to {args.out}")


if __name__ == "__main__":
    main()
