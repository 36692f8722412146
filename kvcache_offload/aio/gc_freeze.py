"""Keep the cycle collector's full passes off the hot path: freeze what exists at start.

A process that imported torch (and Triton, numpy, a model) holds hundreds of thousands of
objects. The engine adds a few long-lived ones per job (stored keys, buffered events), so
every few seconds CPython runs a full collection that walks all of them while the event
loop waits: 80-125 ms on the development VM, 80-175 ms on the H200 host, every job in
flight late by as much (``bench.serving``: single jobs of 120-290 ms cost some engines
10-25 % of a one-second stream and showed as "swings" between engines). Objects alive
when the engine starts are the host's (modules, the model, the KV cache), so the engine
collects once and then ``gc.freeze()``\\ s them: later full passes walk only what was
allocated since. vLLM's GPU worker does the same after its warm-up (``freeze_gc_heap``).

The freeze is process-wide, so it is shared politely: one engine at a time freezes, and
it thaws the heap on close only if nothing was frozen before it (a host or a library that
froze its own objects first keeps them frozen: on the H200 image something at import time
had frozen 375 objects, so "only when nothing is frozen" never froze anything there).
"""

from __future__ import annotations

import gc
import threading

__all__ = ["HeapFreeze"]

_lock = threading.Lock()
_owner: HeapFreeze | None = None
"""The freeze that froze the heap, while it is frozen by one of ours."""


class HeapFreeze:
    """One engine's freeze of the objects alive at its start (``transfer.gc_freeze``)."""

    def __init__(self) -> None:
        self._thaw = False
        """Whether :meth:`release` thaws the heap (nothing was frozen before this freeze)."""

    @property
    def active(self) -> bool:
        return _owner is self

    def freeze(self) -> bool:
        """Collect, then freeze everything alive; False (and nothing done) while another
        engine's freeze holds or the collector is off."""
        global _owner
        with _lock:
            if _owner is not None or not gc.isenabled():
                return False
            self._thaw = gc.get_freeze_count() == 0
            gc.collect()  # so that no garbage of the host's start-up is frozen with it
            gc.freeze()
            _owner = self
            return True

    def release(self) -> None:
        """End this freeze: thaw the heap if nothing was frozen before it, else leave the
        heap frozen (thawing would also thaw what someone else froze)."""
        global _owner
        with _lock:
            if _owner is self:
                _owner = None
                if self._thaw:
                    gc.unfreeze()
