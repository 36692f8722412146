"""The CUDA handlers' completion watcher, with fake copies and waits (no GPU needed).

A GPU test checks that the real watcher sleeps through its EndWait and sees the right bytes;
these check the contract around it on any machine: each copy is waited on in submission order
through the watcher's EndWait, every wait is followed by one callback, the EndWait is released
when the watcher stops, and the watch builds one EndWait per watcher.
"""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("torch")

from kvcache_offload.dataplane.handlers.cuda.inflight import (
    CompletionWatcher,
    CopyWatch,
)


class FakeEndWait:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


class FakeCopy:
    """Ends when its ``ended`` event is set; records what it was waited through."""

    def __init__(self, name: str, log: list[tuple[str, object]]) -> None:
        self.name = name
        self.ended = threading.Event()
        self.watched = False
        self._log = log

    def synchronize(self, end_wait: object = None) -> None:
        self.ended.wait(10.0)
        self._log.append((self.name, end_wait))

    def done(self) -> bool:
        return self.ended.is_set()


def test_the_watcher_waits_in_order_through_its_end_wait_and_releases_it() -> None:
    log: list[tuple[str, object]] = []
    calls = threading.Semaphore(0)
    end_wait = FakeEndWait()
    watcher = CompletionWatcher(calls.release, "test-watcher", end_wait)  # type: ignore[arg-type]
    first, second, third = (FakeCopy(n, log) for n in ("first", "second", "third"))
    for copy in (first, second, third):
        watcher.watch(copy)  # type: ignore[arg-type]
    second.ended.set()
    third.ended.set()  # ended before the head: taken with it, one callback for both
    first.ended.set()
    assert calls.acquire(timeout=10.0)
    watcher.close()
    assert log[0] == ("first", end_wait)
    assert all(waited is end_wait for _, waited in log)
    assert end_wait.closed == 1  # released once its thread ended


def test_the_watcher_without_an_end_wait_passes_none() -> None:
    log: list[tuple[str, object]] = []
    calls = threading.Semaphore(0)
    watcher = CompletionWatcher(calls.release, "test-watcher")
    copy = FakeCopy("only", log)
    copy.ended.set()
    watcher.watch(copy)  # type: ignore[arg-type]
    assert calls.acquire(timeout=10.0)
    watcher.close()
    assert log == [("only", None)]


def test_each_new_watcher_gets_its_own_end_wait_from_the_factory() -> None:
    made: list[FakeEndWait] = []

    def factory() -> FakeEndWait:
        made.append(FakeEndWait())
        return made[-1]

    watch = CopyWatch("test-watch", factory)  # type: ignore[arg-type]
    assert watch.replace(lambda: None, ()) is None
    old = watch.replace(lambda: None, ())  # a new callback: a new watcher, a new EndWait
    assert old is not None
    old.close()
    assert len(made) == 2 and made[0].closed == 1 and made[1].closed == 0
    last = watch.replace(None, ())
    assert last is not None
    last.close()
    assert made[1].closed == 1
    assert len(made) == 2  # stopping the watch builds none


class ReusedCopy(FakeCopy):
    """A copy the loop collected and started again while the watcher still held it: reading
    its events fails, as CUDA's ``cudaEventElapsedTime`` does on a start not reached yet."""

    def done(self) -> bool:
        raise RuntimeError("CUDA error 600 reading a copy's events")


def test_a_copy_reused_under_the_watcher_neither_stops_it_nor_holds_later_copies() -> None:
    log: list[tuple[str, object]] = []
    calls = threading.Semaphore(0)
    watcher = CompletionWatcher(calls.release, "test-watcher")
    head, reused = FakeCopy("head", log), ReusedCopy("reused", log)
    reused.ended.set()
    watcher.watch(head)  # type: ignore[arg-type]
    watcher.watch(reused)  # type: ignore[arg-type]
    head.ended.set()
    assert calls.acquire(timeout=10.0)  # the scan past the head took the reused one
    later = FakeCopy("later", log)
    watcher.watch(later)  # type: ignore[arg-type]
    later.ended.set()
    assert calls.acquire(timeout=10.0)  # still watching
    watcher.close()
    assert [name for name, _ in log] == ["head", "later"]
