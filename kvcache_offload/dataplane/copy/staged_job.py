"""One job on its way through the staged copy path (``staged.py``): its plan, its events and
whether its chunks have been issued yet."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcache_offload.dataplane.copy.plan import TransferPlan

__all__ = ["ISSUED_NOW", "StagedJob"]

ISSUED_NOW = threading.Event()
"""The ``issued`` flag of every job issued on the caller's thread (set from the start)."""
ISSUED_NOW.set()


@dataclass
class StagedJob:
    """One job on its way through the staged path (owned by the handler's transfer)."""

    plan: TransferPlan
    start_event: torch.cuda.Event
    end_event: torch.cuda.Event
    table: Any
    """The handler's ``_TableSlot`` (pinned host table and its device copy)."""
    ready_event: torch.cuda.Event | None = None
    """Recorded on the compute stream at submission (stores wait on it)."""
    prev_end: torch.cuda.Event | None = None
    issued: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    end_recorded: bool = False
