"""Sleeping until a copy ends without blocking-sync events on every copy.

A CUDA event made with ``cudaEventBlockingSync`` lets a host thread sleep until it fires, but
the driver then arms an interrupt for every record of it, and its event thread
(``cuda-EvtHandlr``) took 0.03-0.14 of a core in the H200 streams, also in the streams where
the poller finds every end by looking and nobody sleeps on one (docs/transfers.md,
"Completion"). So the copies' own events spin, and a thread that must sleep until one
fires waits through an :class:`EndWait`: its stream waits on the copy's end event, a
blocking-sync event of its own is recorded there, and the thread sleeps on that one. Only the
copies someone really sleeps on raise an interrupt.
"""

from __future__ import annotations

import logging
import threading

import torch

from kvcache_offload.dataplane.copy.dma import get_cuda_runtime
from kvcache_offload.dataplane.copy.kernel_issue import _address
from kvcache_offload.dataplane.copy.triton_kernel import on_device

__all__ = ["EndWait", "end_wait_available", "end_wait_for"]

logger = logging.getLogger(__name__)

try:
    from kvcache_offload.dataplane.copy._kernel_issue import wait_through as _wait_through
except ImportError:  # built without a C compiler: copies keep blocking-sync events
    _wait_through = None


def end_wait_available() -> bool:
    """Whether :class:`EndWait` can be built here (the C extension and CUDA's runtime)."""
    return _wait_through is not None and get_cuda_runtime() is not None


class EndWait:
    """One waiting thread's stream and blocking-sync event; one :meth:`wait` at a time (a
    lock serialises callers that share one)."""

    def __init__(self, device: torch.device) -> None:
        runtime = get_cuda_runtime()
        if runtime is None or _wait_through is None:
            raise RuntimeError("EndWait needs the _kernel_issue extension and CUDA's runtime")
        lib = runtime.lib
        self._runtime = runtime
        self._functions = (
            _address(lib.cudaStreamWaitEvent),
            _address(lib.cudaEventRecord),
            _address(lib.cudaEventSynchronize),
        )
        with on_device(device):
            self._stream = torch.cuda.Stream(device)
            self._proxy = runtime.event_create(blocking=True)
        self._raw_stream = int(self._stream.cuda_stream)
        self._lock = threading.Lock()
        self._warned = False

    def wait(self, event: torch.cuda.Event) -> None:
        """Return once ``event``'s last record has fired (at once if it was never recorded)."""
        handle = event.cuda_event
        if not handle:
            return
        with self._lock:
            proxy = self._proxy
            if proxy:
                assert _wait_through is not None
                code = _wait_through(*self._functions, handle, self._raw_stream, proxy)
                if code == 0:
                    return
                if not self._warned:
                    self._warned = True
                    logger.warning(
                        "sleeping on a copy's end failed (%s); spinning on the event instead",
                        self._runtime.error_string(code & 0xFFFF),
                    )
        event.synchronize()  # spins: the copies' own events are not blocking-sync

    def close(self) -> None:
        """Release the event (idempotent); a later :meth:`wait` spins on the copy's event."""
        with self._lock:
            proxy, self._proxy = self._proxy, 0
        if proxy:
            self._runtime.event_destroy(proxy)


def end_wait_for(device: torch.device) -> EndWait | None:
    """An :class:`EndWait` for ``device``, or None where none can be built (the copies'
    events are then blocking-sync, as before)."""
    if not end_wait_available():
        return None
    try:
        return EndWait(device)
    except RuntimeError as exc:
        logger.info("copies keep blocking-sync events: %s", exc)
        return None
