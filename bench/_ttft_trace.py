"""Returning conversations drawn from a Mooncake conversation trace, for bench.ttft's
concurrent section.

A request *returns* when its first ``n >= 2`` full blocks (512 tokens each) were already the
prefix of an earlier request: a previous turn of the same conversation (one shared block is
mostly a common system prompt, so it does not count). Its *context* is those ``n`` blocks, its
*new turn* the rest of its input, its *gap* the time since the latest earlier request with
that prefix. ``draw`` picks conversations from those at random (seeded), so their contexts,
turns and gaps follow the trace's shape, then scales them to the model: token counts as they
are on the GPU (capped), or 1/32 of them (one trace block -> 16 tokens) for the tiny model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from kvcache_offload.errors import ConfigError
from kvcache_offload.lab.trace import BLOCK_TOKENS, iter_requests

__all__ = ["Conversation", "draw", "returning"]


@dataclass(frozen=True)
class Conversation:
    """One returning conversation: trace figures and the token counts the model runs."""

    index: int
    """Request number in the trace."""
    trace_context: int
    trace_turn: int
    gap_s: float
    context: int
    turn: int


def returning(path: Path) -> list[tuple[int, int, int, float]]:
    """``(request number, context tokens, new-turn tokens, gap s)`` of every returning
    request of the trace at ``path``, in trace order."""
    seen: dict[tuple[object, ...], float] = {}
    found = []
    for i, req in enumerate(iter_requests(path)):
        full = req.input_length // BLOCK_TOKENS
        for n in range(full, 1, -1):
            ts = seen.get(tuple(req.keys[:n]))
            if ts is not None:
                context = n * BLOCK_TOKENS
                found.append((i, context, req.input_length - context, (req.ts - ts) / 1e3))
                break
        for n in range(2, full + 1):
            seen[tuple(req.keys[:n])] = req.ts
    return found


def draw(
    path: Path, count: int, seed: int, tiny: bool, max_context: int, max_turn: int
) -> list[Conversation]:
    """``count`` returning conversations of the trace at ``path``, scaled to the model (see
    the module docstring), in trace order."""
    pool = returning(path)
    if not 1 <= count <= len(pool):
        raise ConfigError(f"{path} has {len(pool)} returning conversations, {count} wanted")
    picked = sorted(random.Random(seed).sample(pool, count))
    scale = 32 if tiny else 1
    return [
        Conversation(
            index=i,
            trace_context=context,
            trace_turn=turn,
            gap_s=gap,
            context=min(context // scale, max_context),
            turn=max(1, min(-(-turn // scale), max_turn)),
        )
        for i, context, turn, gap in picked
    ]
