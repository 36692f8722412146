"""Worker-side contracts: jobs, results, the handler ABC and its optional capabilities.

The worker never decides anything: it executes (source spec, destination spec) copy jobs
identified by integer job ids and reports which finished.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvcache_offload.contracts.load_store_spec import LoadStoreSpec

__all__ = [
    "BatchesJobs",
    "NotifiesCompletion",
    "OffloadingHandler",
    "SignalsCompletionFd",
    "TransferResult",
    "TransferSpec",
    "TransferType",
    "WatchesOnDemand",
]

logger = logging.getLogger(__name__)

TransferSpec = tuple[LoadStoreSpec, LoadStoreSpec]
"""(source, destination)."""
TransferType = tuple[str, str]
"""(source medium, destination medium), e.g. ("GPU", "CPU") for a store."""


@dataclass
class TransferResult:
    job_id: int
    success: bool
    transfer_size: int | None = None
    """Bytes moved."""
    transfer_time: float | None = None
    """Seconds the copy took on the device (CUDA events) or the copying thread."""
    transfer_type: TransferType | None = None


class OffloadingHandler(ABC):
    """Executes jobs of one direction (or several) asynchronously."""

    @abstractmethod
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Submit a job; True if submitted. Must not block on the copy itself."""

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call, in submission order per direction."""

    @abstractmethod
    def wait(self, job_ids: set[int]) -> None:
        """Block until the given jobs finished; unknown or finished ids are ignored."""

    def shutdown(self) -> None:  # noqa: B027
        """Wait for or drop in-flight jobs and release streams, events and threads."""


@runtime_checkable
class NotifiesCompletion(Protocol):
    """A handler that knows when a job ends and says so, so nobody has to poll it.

    ``callback()`` is called from the handler's own thread after one or more jobs finished
    (several completions may share one call); the caller then reads them with
    ``get_finished``. Handlers without this capability are polled.
    """

    def set_completion_callback(self, callback: Callable[[], None] | None) -> None: ...


@runtime_checkable
class SignalsCompletionFd(Protocol):
    """A notifying handler whose copy thread announces ends on a file descriptor instead.

    Calling back into Python from a copy thread needs the GIL, which a busy event loop holds:
    the thread would wait for it before it could start the next copy. ``completion_fd()``
    returns a descriptor (an eventfd) that becomes readable when a job ended; the caller
    watches it (``loop.add_reader``), reads it to clear it and then calls ``get_finished``.
    The callback of :class:`NotifiesCompletion` still reports what ends on other threads
    (e.g. a copy done inline). ``None``: no descriptor now (shut down).
    """

    def completion_fd(self) -> int | None: ...


@runtime_checkable
class WatchesOnDemand(Protocol):
    """A notifying handler that can leave its copies unwatched until asked.

    After ``set_watch_on_demand(True)`` the handler does not hand new copies to its
    completion thread; the caller looks with ``get_finished`` meanwhile and calls
    ``watch_in_flight()`` before it stops looking, after which the callback fires as usual.
    A small copy that ends while the caller is looking then costs no thread wake-up at all.
    """

    def set_watch_on_demand(self, enabled: bool) -> None: ...

    def watch_in_flight(self) -> None: ...


@runtime_checkable
class BatchesJobs(Protocol):
    """A handler that can hold jobs and issue those submitted close together as one copy.

    After ``set_batching(True)`` the caller promises to call ``flush()`` soon after each
    submission (the engine does it once per event-loop tick); jobs still complete in
    submission order and are reported one by one.
    """

    def set_batching(self, enabled: bool) -> None: ...

    def flush(self) -> None: ...
