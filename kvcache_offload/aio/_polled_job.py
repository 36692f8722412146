"""A job in flight on the poller (its future, completion callback and predicted end), and
what the caller of :meth:`~kvcache_offload.aio.poller.TransferPoller.submit_job` does before
awaiting it.

With ``collect`` True, besides :data:`AWAIT` (nothing to do):

* :data:`COLLECT`: its handler finished the job during the submission (a small copy
  done inline, announced by the completion callback on the loop thread; handlers
  that push every end only, the CPU backend). Nobody was woken; the caller gives
  the loop one turn and calls ``collect_now`` (also when cancelled meanwhile),
  which runs ``on_done`` and resolves the future, instead of the poller task's next
  turn.
* :data:`LOOK`: a lone job on a poller that looks by itself (the CUDA handlers),
  with nothing else in flight. The task stays asleep and the caller looks for the
  end: ``while not future.done() and poller.caller_look(): await <one loop turn>``,
  then ``caller_stop`` (also when cancelled). The end is then collected on the
  caller's own turn, so the future it awaits is resolved before it awaits it: no
  wake-up of the poller task at the submission, and no second task woken (one more
  loop iteration) at the end. A job submitted meanwhile wakes the task as usual.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from kvcache_offload.contracts.handler import TransferResult, TransferSpec

__all__ = ["AWAIT", "COLLECT", "LOOK", "OnDone", "PolledJob", "always", "blocks_and_source"]

OnDone = Callable[[TransferResult], None]

AWAIT, COLLECT, LOOK = 0, 1, 2
"""What :meth:`TransferPoller.submit_job` asks its caller to do before awaiting the future:
nothing; give the loop one turn, then :meth:`~TransferPoller.collect_now`; or look for the
job's end itself (:meth:`~TransferPoller.caller_look`, then
:meth:`~TransferPoller.caller_stop`)."""


@dataclass(slots=True)
class PolledJob:
    future: asyncio.Future[TransferResult]
    on_done: OnDone
    blocks: int = 0
    source: str = ""
    ends: float = 0.0
    """Predicted end (``perf_counter``); 0: not predicted."""


def always() -> bool:
    return True


def blocks_and_source(spec: TransferSpec) -> tuple[int, str]:
    """How many blocks a job names on its source side, and that side's medium."""
    src = spec[0]
    block_ids = getattr(src, "block_ids", None)
    return (len(block_ids) if block_ids is not None else 1), src.medium()
