"""A read-only attribute that divides one field of a result by another.

The lab's results (replay counts, Belady's hits) report rates of their own counters: hits
per requested block, blocks per second of manager time. Each is one declaration here
instead of a property written out per rate, and every one answers 0.0 for an empty trace
instead of dividing by zero.
"""

from __future__ import annotations

from typing import overload

__all__ = ["Ratio"]


class Ratio:
    """``scale * getattr(obj, numerator) / getattr(obj, denominator)``, 0.0 when the
    denominator is 0; not a dataclass field (no annotation), so ``asdict`` leaves it out."""

    def __init__(self, numerator: str, denominator: str, doc: str, scale: float = 1.0) -> None:
        self._numerator = numerator
        self._denominator = denominator
        self._scale = scale
        self.__doc__ = doc

    @overload
    def __get__(self, obj: None, owner: type) -> Ratio: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> float: ...

    def __get__(self, obj: object | None, owner: type | None = None) -> Ratio | float:
        if obj is None:
            return self
        denominator = getattr(obj, self._denominator)
        if not denominator:
            return 0.0
        return float(self._scale * getattr(obj, self._numerator) / denominator)
