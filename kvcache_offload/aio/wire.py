"""JSON of the engine's results, defined once: by their dataclasses in ``aio/types.py``.

The service answers with :func:`to_wire`, the client reads answers back with
:func:`from_wire`, and the OpenAPI document shows them as the routes' response models:
one pydantic ``TypeAdapter`` per dataclass serves all three, so a field added to
``LookupResult``, ``StoreLease``, ``LoadLease``, ``StoreResult`` or ``EngineStats`` reaches
the wire, the client and the schema together. Offload keys travel as hex (``HexKey``).
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from kvcache_offload.aio import types as _types
from kvcache_offload.errors import OffloadError
from kvcache_offload.kv_events.stats import KVEventStats

__all__ = ["WireError", "from_wire", "to_wire"]

T = TypeVar("T")


class WireError(OffloadError):
    """A service answer does not have the shape its dataclass defines (client and server
    out of step)."""


# EngineStats names KVEventStats for type checkers only (a runtime import there would be a
# cycle through kv_events); now that both modules exist, make the name resolvable for pydantic
# and for FastAPI's OpenAPI generation.
setattr(_types, "KVEventStats", KVEventStats)  # noqa: B010


_ADAPTERS: dict[type[Any], TypeAdapter[Any]] = {}


def _adapter(cls: type[Any]) -> TypeAdapter[Any]:
    adapter = _ADAPTERS.get(cls)
    if adapter is None:
        adapter = _ADAPTERS[cls] = TypeAdapter(cls)
    return adapter


def to_wire(value: Any, *, exclude_none: bool = False) -> Any:
    """``value`` (one of the result dataclasses) as JSON-ready values."""
    return _adapter(type(value)).dump_python(value, mode="json", exclude_none=exclude_none)


def from_wire(cls: type[T], data: Any) -> T:
    """``data`` (decoded JSON) as a ``cls``; :class:`WireError` when it does not fit."""
    try:
        value: T = _adapter(cls).validate_python(data)
    except ValidationError as exc:
        raise WireError(f"the service's answer is not a {cls.__name__}: {exc}") from None
    return value
