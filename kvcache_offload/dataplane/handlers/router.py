"""Routes each job to the handler registered for its (source, destination) media."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from kvcache_offload.contracts.handler import (
    BatchesJobs,
    NotifiesCompletion,
    OffloadingHandler,
    SignalsCompletionFd,
    TransferResult,
    TransferSpec,
    TransferType,
    WatchesOnDemand,
)
from kvcache_offload.contracts.load_store_spec import LoadStoreSpec
from kvcache_offload.dataplane.handlers.held_jobs import BatchingSwitch, HeldJobs
from kvcache_offload.errors import ConfigError, TransferError

__all__ = ["OffloadingWorker"]

logger = logging.getLogger(__name__)


def _always() -> bool:
    return True


def _hold_probe(handler: BatchesJobs) -> Callable[[], bool]:
    """The handler's ``holds_jobs`` (the shared ``BatchingSwitch`` has one); a third-party
    batching handler without it is asked to flush after every submission, as the contract
    promises it."""
    probe = getattr(handler, "holds_jobs", None)
    return probe if callable(probe) else _always


class OffloadingWorker:
    """Routes each job to the handler registered for its (source, destination) media."""

    def __init__(self) -> None:
        self.handlers: list[OffloadingHandler] = []
        self.transfer_type_to_handler: dict[TransferType, OffloadingHandler] = {}
        self._by_classes: dict[tuple[type, type], OffloadingHandler] = {}
        """The handler of each (source, destination) spec class pair seen so far."""
        self._batching: list[BatchesJobs] = []
        self._held: list[HeldJobs[Any]] = []
        """The held batches of the handlers that share ``BatchingSwitch``."""
        self._hold_probes: list[Callable[[], bool]] = []
        """``holds_jobs`` of the other batching handlers."""
        self._on_demand: list[WatchesOnDemand] = []
        self.last_refusal: tuple[int, Exception] | None = None
        """The job id and the exception of the last job a handler raised for (the poller
        names it in its error)."""

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
        self._by_classes.clear()
        if all(h is not handler for h in self.handlers):
            self.handlers.append(handler)

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Submit a job; a handler that raises or refuses yields False, never an exception."""
        src, dst = spec
        classes = (type(src), type(dst))
        handler = self._by_classes.get(classes)
        if handler is None:
            transfer_type = (src.medium(), dst.medium())
            handler = self.transfer_type_to_handler.get(transfer_type)
            if handler is None:
                logger.warning("no handler for transfer type %s (job %d)", transfer_type, job_id)
                return False
            # A spec class names one medium (``medium()`` is static): route its pair by
            # class from now on, without two calls per job.
            self._by_classes[classes] = handler
        try:
            success = handler.transfer_async(job_id, spec)
        except Exception as exc:
            self.last_refusal = (job_id, exc)
            logger.warning(
                "handler raised submitting job %d (%s): %s",
                job_id,
                (src.medium(), dst.medium()),
                exc,
                # A job the handler checked and refused (ids out of range) needs no trace.
                exc_info=not isinstance(exc, TransferError),
            )
            return False
        if not success:
            logger.warning("failed to submit job %d (%s)", job_id, (src.medium(), dst.medium()))
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

    def completion_fds(self) -> list[int]:
        """The descriptors of the handlers that announce ends on one (see
        :class:`SignalsCompletionFd`): the caller watches them and polls when one is readable."""
        fds = []
        for handler in self.handlers:
            if isinstance(handler, SignalsCompletionFd):
                fd = handler.completion_fd()
                if fd is not None:
                    fds.append(fd)
        return fds

    def enable_watch_on_demand(self) -> bool:
        """Let every handler that can leave its copies unwatched until :meth:`watch_in_flight`
        do so; True if any can."""
        self._on_demand = [h for h in self.handlers if isinstance(h, WatchesOnDemand)]
        for handler in self._on_demand:
            handler.set_watch_on_demand(True)
        return bool(self._on_demand)

    def watch_in_flight(self) -> None:
        """Have the on-demand handlers watch every copy in flight (the caller stops looking)."""
        for handler in self._on_demand:
            handler.watch_in_flight()

    def enable_batching(self) -> bool:
        """Turn batching on in every handler that can batch; True if any can."""
        # Checked once here: an isinstance against a runtime Protocol costs ~10 us, too
        # much for the once-per-tick flush.
        self._batching = [h for h in self.handlers if isinstance(h, BatchesJobs)]
        for handler in self._batching:
            handler.set_batching(True)
        self._held = [h.held_jobs() for h in self._batching if isinstance(h, BatchingSwitch)]
        self._hold_probes = [
            _hold_probe(h) for h in self._batching if not isinstance(h, BatchingSwitch)
        ]
        return bool(self._batching)

    def holds_jobs(self) -> bool:
        """Whether a batching handler holds a job, so that :meth:`flush` has work to do
        (a handler that cannot say is assumed to hold one). Asked once per submission."""
        for held in self._held:
            if held.jobs:
                return True
        for probe in self._hold_probes:  # noqa: SIM110 - per job: no generator for any()
            if probe():
                return True
        return False

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
