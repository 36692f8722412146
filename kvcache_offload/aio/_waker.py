"""A resettable wake-up signal for one background task, usable from other threads.

The poller and the lease reaper each sleep on one of these: ``wait(timeout)`` returns when
woken or when the timeout passes, so an idle task costs no CPU. A wake that arrives while
the task is busy is remembered and makes the next ``wait`` return at once (no lost wake-ups).
"""

from __future__ import annotations

import asyncio
import contextlib

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

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def wake(self) -> None:
        """Wake the waiting task (call on the loop thread)."""
        self._woken = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def wake_threadsafe(self) -> None:
        """Wake the waiting task from any thread; a no-op once the loop is gone."""
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed
            loop.call_soon_threadsafe(self.wake)

    async def wait(self, timeout: float | None = None) -> None:
        """Return when woken (or at once if a wake is pending) or after ``timeout`` seconds."""
        if self._woken:
            self._woken = False
            return
        loop = asyncio.get_running_loop()
        self._loop = loop
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
