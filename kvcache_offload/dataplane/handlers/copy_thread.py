"""One worker thread that runs a direction's copies in submission order.

What a ``ThreadPoolExecutor(max_workers=1)`` gives, without what a copy per job does not
need: no ``Future`` with its own lock and condition per copy, no work-item object, no
pool-size check per submission, and a wake-up only when the thread is actually waiting (a
copy queued behind a running one costs an ``append``). On a 2-vCPU host the executor's
``submit`` was the largest single cost of handing a job to the copy thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["CopyThread", "QueuedCopy"]


class QueuedCopy:
    """One copy on its way through the thread; read without a lock once :meth:`done`."""

    __slots__ = ("_cancelled", "_done", "_error", "_seconds", "args", "fn")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        self._done = False
        self._cancelled = False
        self._seconds = 0.0
        self._error: BaseException | None = None

    @classmethod
    def ran_now(cls, fn: Callable[..., Any], *args: Any) -> QueuedCopy:
        """A copy run on the calling thread, finished when this returns."""
        item = cls(fn, args)
        item.run()
        item._done = True
        return item

    def finish(self, seconds: float, cancelled: bool = False) -> None:
        """Mark a copy that ran elsewhere (a native queue) as ended after ``seconds``."""
        self._seconds = seconds
        self._cancelled = cancelled
        self._done = True

    def run(self) -> None:
        """Run the copy, keeping its time or its error (a failed copy is a failed job)."""
        start = time.perf_counter()
        try:
            self.fn(*self.args)
            self._seconds = time.perf_counter() - start
        except Exception as exc:
            self._error = exc

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return self._cancelled

    def exception(self) -> BaseException | None:
        return self._error

    def outcome(self) -> tuple[bool, BaseException | None, float]:
        """``(cancelled, error, seconds)`` of a done copy in one call (read once per job)."""
        return self._cancelled, self._error, self._seconds

    def result(self) -> float:
        if self._error is not None:
            raise self._error
        return self._seconds


class CopyThread:
    """Runs :class:`QueuedCopy` items one at a time, in order; ``on_done`` after each."""

    def __init__(self, name: str, on_done: Callable[[], None]) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._queue: deque[QueuedCopy] = deque()
        self._idle = False  # the thread waits on the condition: a submission must wake it
        self._waiters = 0  # callers of wait(): a finished copy must wake them
        self._closed = False
        self._on_done = on_done
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> QueuedCopy:
        item = QueuedCopy(fn, args)
        with self._cv:
            if self._closed:
                raise RuntimeError("the copy thread is shut down")
            self._queue.append(item)
            if self._idle:
                self._cv.notify()
        return item

    def wait(self, items: list[QueuedCopy]) -> None:
        """Block until every item finished or was cancelled."""
        with self._cv:
            self._waiters += 1
            try:
                while not all(i.done() for i in items):
                    self._cv.wait()
            finally:
                self._waiters -= 1

    def _run(self) -> None:
        cv = self._cv
        while True:
            with cv:
                while not self._queue:
                    if self._closed:
                        return
                    self._idle = True
                    cv.wait()
                    self._idle = False
                item = self._queue.popleft()
            try:
                item.run()
            except BaseException as exc:  # reported as a failed job, never raised here
                item._error = exc
            with cv:
                item._done = True
                if self._waiters:
                    cv.notify_all()
            self._on_done()

    def shutdown(self) -> None:
        """Cancel the copies not started, let the running one finish, stop. Idempotent."""
        with self._cv:
            self._closed = True
            for item in self._queue:
                item._cancelled = True
                item._done = True
            self._queue.clear()
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
