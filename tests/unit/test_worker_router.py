"""OffloadingWorker routing (reference 10.4): submission failures, per-handler queues, order."""

from __future__ import annotations

import pytest

from kvcache_offload.contracts.handler import (
    OffloadingHandler,
    TransferResult,
    TransferSpec,
)
from kvcache_offload.contracts.load_store_spec import LoadStoreSpec
from kvcache_offload.dataplane.handlers.router import OffloadingWorker
from kvcache_offload.errors import ConfigError


class Spec1(LoadStoreSpec):
    def __init__(self, outcome: str = "ok") -> None:
        self.outcome = outcome  # "ok", "fail" (finishes unsuccessfully), "raise", "refuse"
        self.finished = False

    @staticmethod
    def medium() -> str:
        return "1"


class Spec2(Spec1):
    @staticmethod
    def medium() -> str:
        return "2"


class FakeHandler(OffloadingHandler):
    """Jobs finish (in order) once their source spec is marked finished."""

    def __init__(self, transfer_type: tuple[str, str]) -> None:
        self.transfer_type = transfer_type
        self.pending: list[tuple[int, Spec1]] = []
        self.waited: list[set[int]] = []
        self.shut = False

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        src = spec[0]
        assert isinstance(src, Spec1)
        if src.outcome == "raise":
            raise RuntimeError("handler exploded")
        if src.outcome == "refuse":
            return False
        self.pending.append((job_id, src))
        return True

    def get_finished(self) -> list[TransferResult]:
        out = []
        while self.pending and self.pending[0][1].finished:
            job_id, src = self.pending.pop(0)
            out.append(TransferResult(job_id, src.outcome == "ok", 1, 0.0, self.transfer_type))
        return out

    def wait(self, job_ids: set[int]) -> None:
        self.waited.append(set(job_ids))

    def shutdown(self) -> None:
        self.shut = True


def _worker() -> tuple[OffloadingWorker, FakeHandler, FakeHandler]:
    worker = OffloadingWorker()
    h12, h21 = FakeHandler(("1", "2")), FakeHandler(("2", "1"))
    worker.register_handler(Spec1, Spec2, h12)
    worker.register_handler(Spec2, Spec1, h21)
    return worker, h12, h21


def test_router_turns_raising_and_refusing_handlers_into_false_and_keeps_order():
    worker, h12, h21 = _worker()
    assert worker.transfer_async(1, (Spec1("raise"), Spec2())) is False
    assert worker.transfer_async(2, (Spec1("refuse"), Spec2())) is False
    s3, s4 = Spec1("fail"), Spec1("ok")
    assert worker.transfer_async(3, (s3, Spec2())) is True
    assert worker.transfer_async(4, (s4, Spec2())) is True
    assert [j for j, _ in h12.pending] == [3, 4]
    s5 = Spec2("ok")
    assert worker.transfer_async(5, (s5, Spec1())) is True
    assert [j for j, _ in h21.pending] == [5]
    assert worker.get_finished() == []
    s6, s7 = Spec1("ok"), Spec1("ok")
    assert worker.transfer_async(6, (s6, Spec2()))
    assert worker.transfer_async(7, (s7, Spec2()))
    s4.finished = True  # 4 done but 3 is not: nothing is reported out of order
    assert worker.get_finished() == []
    s3.finished = True
    assert worker.get_finished() == [
        TransferResult(3, False, 1, 0.0, ("1", "2")),
        TransferResult(4, True, 1, 0.0, ("1", "2")),
    ]
    s6.finished = s7.finished = s5.finished = True
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [
        (6, True),
        (7, True),
        (5, True),
    ]


def test_router_without_a_handler_for_the_media_returns_false():
    worker = OffloadingWorker()
    worker.register_handler(Spec1, Spec2, FakeHandler(("1", "2")))
    assert worker.transfer_async(1, (Spec2(), Spec1())) is False


def test_registering_a_direction_twice_is_an_error_but_one_handler_may_serve_both():
    worker = OffloadingWorker()
    both = FakeHandler(("x", "y"))
    worker.register_handler(Spec1, Spec2, both)
    worker.register_handler(Spec2, Spec1, both)
    assert worker.handlers == [both]
    with pytest.raises(ConfigError):
        worker.register_handler(Spec1, Spec2, FakeHandler(("1", "2")))


def test_wait_and_shutdown_reach_every_handler():
    worker, h12, h21 = _worker()
    worker.wait([1, 2])
    assert h12.waited == [{1, 2}] and h21.waited == [{1, 2}]
    worker.shutdown()
    assert h12.shut and h21.shut


class _BatchingFake(FakeHandler):
    """A third-party batching handler: set_batching and flush, no way to say what it holds."""

    def __init__(self, transfer_type: tuple[str, str]) -> None:
        super().__init__(transfer_type)
        self.flushes = 0

    def set_batching(self, enabled: bool) -> None:
        pass

    def flush(self) -> None:
        self.flushes += 1


def test_holds_jobs_reads_shared_batches_and_assumes_a_job_for_handlers_that_cannot_say():
    from kvcache_offload.dataplane.handlers.held_jobs import BatchingSwitch, HeldJobs

    class Shared(BatchingSwitch, FakeHandler):
        def __init__(self, transfer_type: tuple[str, str]) -> None:
            FakeHandler.__init__(self, transfer_type)
            self._held = HeldJobs()
            self._batching = False

        def _flush_locked(self) -> None:
            self._held.take()

    import threading

    shared = Shared(("1", "2"))
    shared._lock = threading.Lock()
    worker = OffloadingWorker()
    worker.register_handler(Spec1, Spec2, shared)
    assert worker.enable_batching()
    assert not worker.holds_jobs()  # nothing held: the poller schedules no flush
    shared._held.add(7, _empty_plan())
    assert worker.holds_jobs() and shared.holds_jobs()
    worker.flush()
    assert not worker.holds_jobs()

    other = _BatchingFake(("2", "1"))
    worker.register_handler(Spec2, Spec1, other)
    assert worker.enable_batching()
    assert worker.holds_jobs()  # it cannot say, so it is flushed after every submission


def _empty_plan():  # type: ignore[no-untyped-def]
    from kvcache_offload.dataplane.copy.plan import TransferPlan

    return TransferPlan([], 0, 0, None, 0, 1)
