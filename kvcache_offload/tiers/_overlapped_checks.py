"""OverlappedChecks: verify one item on a second thread while the caller reads the next.

Why: a verified disk read passes over every byte twice, the kernel's copy out of the page
cache and then XXH3 over the copy. With the page cache warm the second pass cost ~30% of a
plain read of 2 MiB blocks, in the reading thread. Both passes release the GIL (a ``read``
syscall, and xxhash for large buffers), so the check of block *i* can run on another core
while block *i + 1* is read; a batch then costs its reads plus the check of its last block.
The caller checks the last block of a batch itself (nothing left to overlap it with), so a
one-block batch never hands off, and a machine with no idle core pays a thread hand-off per
block, not a second pass.

One thread per tier, started on first use and stopped by :meth:`close` (a later use starts
it again); the checks of all batches in flight share it (a check takes less time than a read,
so one thread keeps up with a reader).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

__all__ = ["OverlappedChecks"]

_T = TypeVar("_T")


class _Done(Generic[_T]):
    """A check already run by the caller, with the same ``result()`` as a future."""

    __slots__ = ("_value",)

    def __init__(self, value: _T) -> None:
        self._value = value

    def result(self) -> _T:
        return self._value


class OverlappedChecks:
    """A one-thread pool for checks that overlap the caller's next read; see the module doc."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._pool = self._new_pool()

    def _new_pool(self) -> ThreadPoolExecutor:
        # No thread runs until the first submit.
        return ThreadPoolExecutor(1, thread_name_prefix=f"kvo-{self._name}-check")

    def start(self, check: Callable[..., _T], *args: object, last: bool) -> Future[_T] | _Done[_T]:
        """Run ``check(*args)`` on the check thread, or here and now when it is ``last``."""
        if last:
            return _Done(check(*args))
        return self._pool.submit(check, *args)

    def close(self) -> None:
        """Stop the thread once the checks already started are done (blocking: off the loop)."""
        pool, self._pool = self._pool, self._new_pool()
        pool.shutdown(wait=True)
