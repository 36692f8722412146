"""``async with`` for objects that own resources released by ``aclose()``.

The client, event subscriptions and anything else closed by ``aclose()`` inherit entering and
leaving from here instead of spelling the two methods out each time.
"""

from __future__ import annotations

from types import TracebackType
from typing import Self

__all__ = ["AsyncClosing"]


class AsyncClosing:
    """Entering returns the object; leaving (normally or by an exception) awaits ``aclose``."""

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
