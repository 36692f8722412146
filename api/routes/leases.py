"""Sidecar mode: prepare a store or load, copy through the shared region, then complete it."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from api.deps import EngineLike, get_config, get_engine
from api.responses import FastJSONResponse
from api.routes._keys import hex_keys, request_context, resolve_keys
from api.schemas import (
    LoadCompleted,
    LoadCompleteRequest,
    LoadLeaseOut,
    PrepareRequest,
    StoreCompleted,
    StoreCompleteRequest,
    StoreLeaseOut,
)
from kvcache_offload.config import OffloadConfig

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["leases"])

Engine = Annotated[EngineLike, Depends(get_engine)]
Config = Annotated[OffloadConfig, Depends(get_config)]


@router.post("/store/prepare", response_model=StoreLeaseOut)
async def prepare_store(body: PrepareRequest, engine: Engine, config: Config) -> FastJSONResponse:
    """Allocate CPU slots for the keys not yet offloaded (evicting if needed) under a lease."""
    keys = resolve_keys(body, config.max_keys_per_request)
    lease = await engine.prepare_store(keys, request_context(body), ttl_s=body.ttl_s)
    return FastJSONResponse(
        {
            "lease_id": lease.lease_id,
            "keys_to_store": hex_keys(lease.keys_to_store),
            "block_ids": [int(b) for b in lease.block_ids],
            "evicted_keys": hex_keys(lease.evicted_keys),
            "expires_at": lease.expires_at,
        }
    )


@router.post("/store/complete", response_model=StoreCompleted)
async def complete_store(body: StoreCompleteRequest, engine: Engine) -> FastJSONResponse:
    """Make the lease's blocks loadable, or roll them back with ``success: false``."""
    keys = await engine.complete_store(body.lease_id, body.success)
    return FastJSONResponse({"lease_id": body.lease_id, "keys": hex_keys(keys)})


@router.post("/load/prepare", response_model=LoadLeaseOut)
async def prepare_load(body: PrepareRequest, engine: Engine, config: Config) -> FastJSONResponse:
    """Pin ready blocks for reading under a lease; 409 if any is not ready."""
    keys = resolve_keys(body, config.max_keys_per_request)
    lease = await engine.prepare_load(keys, request_context(body), ttl_s=body.ttl_s)
    return FastJSONResponse(
        {
            "lease_id": lease.lease_id,
            "keys": hex_keys(lease.keys),
            "block_ids": [int(b) for b in lease.block_ids],
            "expires_at": lease.expires_at,
        }
    )


@router.post("/load/complete", response_model=LoadCompleted)
async def complete_load(body: LoadCompleteRequest, engine: Engine) -> FastJSONResponse:
    """Unpin the lease's blocks."""
    await engine.complete_load(body.lease_id)
    return FastJSONResponse({"lease_id": body.lease_id})
