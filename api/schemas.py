"""Request and response bodies of the HTTP API (pydantic), keys travelling as hex strings.

A request names its blocks either by ``keys`` (hex offload keys: block hash + 4-byte group
index) or by ``token_ids`` + ``block_size`` (+ ``group_idx``, ``salt``), from which the server
derives chained keys with :mod:`kvcache_offload.keys`.

Responses that carry results (lookup, leases, written blocks, stats) are the engine's own
dataclasses in ``kvcache_offload/aio/types.py``, serialised by ``kvcache_offload/aio/wire.py``.
"""

from __future__ import annotations

import warnings
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from kvcache_offload.aio import types as _results
from kvcache_offload.aio.types import HEX_KEY_PATTERN

__all__ = [
    "MAX_LEASE_TTL_S",
    "ErrorBody",
    "HexKey",
    "KeysRequest",
    "LeaseRequest",
    "LoadCompleteRequest",
    "LoadCompleted",
    "PrepareRequest",
    "StoreCompleteRequest",
    "StoreCompleted",
    "Touched",
]

MAX_LEASE_TTL_S = 3600.0
"""Upper bound on a client-chosen lease TTL: a crashed client must not pin blocks for long."""

HexKey = Annotated[
    str,
    StringConstraints(pattern=HEX_KEY_PATTERN),
    Field(description="Offload key as hex: block hash bytes + 4-byte big-endian group index."),
]
TokenId = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]

_STRICT = ConfigDict(extra="forbid")


class KeysRequest(BaseModel):
    """Blocks named by hex keys, or by token ids from which chained keys are derived."""

    model_config = _STRICT

    keys: list[HexKey] | None = Field(default=None, description="Hex offload keys, in order.")
    token_ids: list[TokenId] | None = Field(
        default=None, description="Token ids; one key per full block of block_size tokens."
    )
    block_size: int | None = Field(default=None, gt=0, le=1 << 20)
    group_idx: int = Field(default=0, ge=0, le=2**32 - 1)
    salt: str | None = Field(default=None, max_length=1024)
    req_id: str = Field(default="", max_length=1024)

    @model_validator(mode="after")
    def _one_source(self) -> KeysRequest:
        if (self.keys is None) == (self.token_ids is None):
            raise ValueError("give exactly one of 'keys' or 'token_ids'")
        if self.token_ids is not None and self.block_size is None:
            raise ValueError("'token_ids' needs 'block_size'")
        return self


class PrepareRequest(KeysRequest):
    """A prepare call: the keys plus an optional lease TTL (config.lease_ttl_s when absent)."""

    ttl_s: float | None = Field(default=None, gt=0, le=MAX_LEASE_TTL_S)


class LeaseRequest(BaseModel):
    model_config = _STRICT

    lease_id: str = Field(min_length=1, max_length=256)


class CopyReport(BaseModel):
    """What the client's own copy moved, so transfer metrics include sidecar traffic."""

    model_config = _STRICT

    transfer_bytes: int | None = Field(
        default=None, ge=0, le=2**53, description="Bytes the client copied."
    )
    transfer_seconds: float | None = Field(
        default=None, ge=0, le=86_400, description="Seconds the client's copy took."
    )


class StoreCompleteRequest(LeaseRequest, CopyReport):
    success: bool = Field(default=True, description="False rolls the store back.")


class LoadCompleteRequest(LeaseRequest, CopyReport):
    pass


class Touched(BaseModel):
    touched: int


class Released(BaseModel):
    released: int = Field(description="Present keys marked to be evicted first.")


class Discarded(BaseModel):
    discarded: list[str] = Field(
        description="Keys freed (hex); absent keys and blocks being written or read stay."
    )


class StoreCompleted(BaseModel):
    lease_id: str
    keys: list[str] = Field(description="Keys the completion made loadable (or dropped).")


class LoadCompleted(BaseModel):
    lease_id: str


class ErrorBody(BaseModel):
    error: str = Field(description="Error class, e.g. CapacityError or ValidationError.")
    detail: Any = Field(description="What was wrong and what was expected.")


_MOVED = {
    "LookupOut": "LookupResult",
    "StoreLeaseOut": "StoreLease",
    "LoadLeaseOut": "LoadLease",
    "BlocksWritten": "StoreResult",
}


def __getattr__(name: str) -> Any:
    """The response models that became the engine's dataclasses, under their old names."""
    new = _MOVED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"{__name__}.{name} is kvcache_offload.aio.types.{new} now",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(_results, new)
