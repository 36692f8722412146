"""A resettable wake-up signal for one background task, usable from other threads.

The poller and the lease reaper each sleep on one of these: ``wait(timeout)`` returns when
woken or when the timeout passes, so an idle task costs no CPU. A wake that arrives while
the task is busy is remembered and makes the next ``wait`` return at once (no lost wake-ups).
"""

from __future__ import annotations

import asyncio
import threading

__all__ = ["Waker"]


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Waker:
    """One waiter at a time; ``wake`` on the loop thread, ``wake_threadsafe`` from anywhere."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._woken = False
        self._wake_scheduled = False
        self._loop_thread: int | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is self._loop:  # called per submission: a loop runs on one thread
            return
        self._loop = loop
        self._loop_thread = threading.get_ident()

    def on_loop_thread(self) -> bool:
        """Whether the caller runs on the bound loop's thread."""
        return threading.get_ident() == self._loop_thread

    def wake(self) -> None:
        """Wake the waiting task (call on the loop thread)."""
        self._woken = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def wake_threadsafe(self) -> None:
        """Wake the waiting task from any thread; a no-op once the loop is gone.

        Wakes that arrive while one is already scheduled are folded into it (one self-pipe
        write per loop iteration, however many copies finish): the flag is cleared before
        the wake runs, so whatever happened before a folded call is seen by the woken task.
        """
        loop = self._loop
        if loop is None or self._wake_scheduled:
            return
        if self.on_loop_thread():  # e.g. a copy done inline
            self.wake()
            return
        self._wake_scheduled = True
        try:
            loop.call_soon_threadsafe(self._wake_from_thread)
        except RuntimeError:  # the loop is closed
            self._wake_scheduled = False

    def _wake_from_thread(self) -> None:
        self._wake_scheduled = False
        self.wake()

    async def wait(self, timeout: float | None = None) -> None:
        """Return when woken (or at once if a wake is pending) or after ``timeout`` seconds."""
        if self._woken:
            self._woken = False
            return
        loop = asyncio.get_running_loop()
        self.bind(loop)
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiter = waiter
        timer = loop.call_later(timeout, _resolve, waiter) if timeout is not None else None
        try:
            await waiter
        finally:
            self._waiter = None
            self._woken = False
            if timer is not None:
                timer.cancel()
