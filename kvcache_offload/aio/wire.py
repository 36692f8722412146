"""JSON of the engine's results, defined once: by their dataclasses in ``aio/types.py``.

The service answers with :func:`to_wire`, the client reads answers back with
:func:`from_wire`, and the OpenAPI document shows the dataclasses as the routes' response
models, so a field added to ``LookupResult``, ``StoreLease``, ``LoadLease``, ``StoreResult``
or ``EngineStats`` reaches the wire, the client and the schema together. Offload keys travel
as hex (fields typed ``HexKey``).

Reading and the schema go through pydantic. Writing does not: lookup is the call a scheduler
makes per request, and pydantic's JSON mode costs ~100 us for a 64-key answer where this
field plan costs a few (the result is the same; a test compares the two).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from kvcache_offload.aio.types import HexKey
from kvcache_offload.errors import OffloadError

__all__ = ["WireError", "from_wire", "to_wire"]

T = TypeVar("T")

_KEYS = (list[HexKey], list[HexKey] | None)
_AS_IS, _HEX, _NESTED = 0, 1, 2


class WireError(OffloadError):
    """A service answer does not have the shape its dataclass defines (client and server
    out of step)."""


_ADAPTERS: dict[type[Any], TypeAdapter[Any]] = {}
_PLANS: dict[type[Any], tuple[tuple[str, int], ...]] = {}


def _adapter(cls: type[Any]) -> TypeAdapter[Any]:
    adapter = _ADAPTERS.get(cls)
    if adapter is None:
        adapter = _ADAPTERS[cls] = TypeAdapter(cls)
    return adapter


def _nested(hint: Any) -> bool:
    """Whether values of ``hint`` hold dataclasses or mappings (converted deeply)."""
    if dataclasses.is_dataclass(hint) or typing.get_origin(hint) is dict:
        return True
    return any(_nested(arg) for arg in typing.get_args(hint))


def _plan(cls: type[Any]) -> tuple[tuple[str, int], ...]:
    plan = _PLANS.get(cls)
    if plan is None:
        hints = typing.get_type_hints(cls, include_extras=True)
        plan = _PLANS[cls] = tuple(
            (f.name, _HEX if hints[f.name] in _KEYS else _NESTED if _nested(hints[f.name]) else 0)
            for f in dataclasses.fields(cls)
        )
    return plan


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_wire(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def to_wire(value: Any, *, exclude_none: bool = False) -> dict[str, Any]:
    """``value`` (a result dataclass) as JSON-ready values: keys as hex, mapping keys as text."""
    out: dict[str, Any] = {}
    for name, kind in _plan(type(value)):
        field = getattr(value, name)
        if field is None:
            if not exclude_none:
                out[name] = None
        elif kind == _HEX:
            out[name] = [key.hex() for key in field]
        else:
            out[name] = _plain(field) if kind == _NESTED else field
    return out


def from_wire(cls: type[T], data: Any) -> T:
    """``data`` (decoded JSON) as a ``cls``; :class:`WireError` when it does not fit."""
    try:
        value: T = _adapter(cls).validate_python(data)
    except ValidationError as exc:
        raise WireError(f"the service's answer is not a {cls.__name__}: {exc}") from None
    return value
