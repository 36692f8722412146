"""Worker-side contracts: jobs, results, handlers and the router that picks a handler.

The worker never decides anything: it executes (source spec, destination spec) copy jobs
identified by integer job ids and reports which finished.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvcache_offload.base import LoadStoreSpec
from kvcache_offload.errors import ConfigError

__all__ = [
    "BatchesJobs",
    "NotifiesCompletion",
    "OffloadingHandler",
    "OffloadingWorker",
    "TransferResult",
    "TransferSpec",
    "TransferType",
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
class BatchesJobs(Protocol):
    """A handler that can hold jobs and issue those submitted close together as one copy.

    After ``set_batching(True)`` the caller promises to call ``flush()`` soon after each
    submission (the engine does it once per event-loop tick); jobs still complete in
    submission order and are reported one by one.
    """

    def set_batching(self, enabled: bool) -> None: ...

    def flush(self) -> None: ...


class OffloadingWorker:
    """Routes each job to the handler registered for its (source, destination) media."""

    def __init__(self) -> None:
        self.handlers: list[OffloadingHandler] = []
        self.transfer_type_to_handler: dict[TransferType, OffloadingHandler] = {}
        self._batching: list[BatchesJobs] = []

    def register_handler(
        self,
        src_cls: type[LoadStoreSpec],
        dst_cls: type[LoadStoreSpec],
        handler: OffloadingHandler,
    ) -> None:
        transfer_type = (src_cls.medium(), dst_cls.medium())
        if transfer_type in self.transfer_type_to_handler:
            raise ConfigError(f"a handler for {transfer_type} is already registered")
        self.transfer_type_to_handler[transfer_type] = handler
        if all(h is not handler for h in self.handlers):
            self.handlers.append(handler)

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Submit a job; a handler that raises or refuses yields False, never an exception."""
        src, dst = spec
        transfer_type = (src.medium(), dst.medium())
        handler = self.transfer_type_to_handler.get(transfer_type)
        if handler is None:
            logger.warning("no handler for transfer type %s (job %d)", transfer_type, job_id)
            return False
        try:
            success = handler.transfer_async(job_id, spec)
        except Exception:
            logger.warning(
                "handler raised submitting job %d (%s)", job_id, transfer_type, exc_info=True
            )
            return False
        if not success:
            logger.warning("failed to submit job %d (%s)", job_id, transfer_type)
        return success

    def get_finished(self) -> list[TransferResult]:
        finished: list[TransferResult] = []
        for handler in self.handlers:
            finished.extend(handler.get_finished())
        return finished

    def wait(self, job_ids: Iterable[int]) -> None:
        ids = set(job_ids)
        for handler in self.handlers:
            handler.wait(ids)

    def set_completion_callback(self, callback: Callable[[], None] | None) -> bool:
        """Give ``callback`` to every handler that can notify; True if all of them can."""
        every = True
        for handler in self.handlers:
            if isinstance(handler, NotifiesCompletion):
                handler.set_completion_callback(callback)
            else:
                every = False
        return every

    def enable_batching(self) -> bool:
        """Turn batching on in every handler that can batch; True if any can."""
        # Checked once here: an isinstance against a runtime Protocol costs ~10 us, too
        # much for the once-per-tick flush.
        self._batching = [h for h in self.handlers if isinstance(h, BatchesJobs)]
        for handler in self._batching:
            handler.set_batching(True)
        return bool(self._batching)

    def flush(self) -> None:
        """Issue the jobs held by batching handlers; a handler that raises is logged."""
        for handler in self._batching:
            try:
                handler.flush()
            except Exception:
                logger.exception("flushing held jobs failed")

    def shutdown(self) -> None:
        for handler in self.handlers:
            try:
                handler.shutdown()
            except Exception:
                logger.warning("handler shutdown failed", exc_info=True)
