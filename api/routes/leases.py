"""Sidecar mode: prepare a store or load, copy through the shared region, then complete it."""

from __future__ import annotations

from fastapi import APIRouter, Request

from api.responses import FastJSONResponse
from api.routes._body import json_body, parse_body
from api.routes._keys import hex_keys, parse_keys, remember_block_tokens, request_context
from api.routes._state import config_of, engine_of
from api.schemas import (
    LoadCompleted,
    LoadCompleteRequest,
    LoadLeaseOut,
    PrepareRequest,
    StoreCompleted,
    StoreCompleteRequest,
    StoreLeaseOut,
)
from kvcache_offload.errors import NoSharedRegionError

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["leases"])


@router.post(
    "/store/prepare", response_model=StoreLeaseOut, openapi_extra=json_body(PrepareRequest)
)
async def prepare_store(request: Request) -> FastJSONResponse:
    """Allocate CPU slots for the keys not yet offloaded (evicting if needed) under a lease."""
    config = config_of(request)
    if not config.shared_region:
        # The client would copy into memory it cannot reach; the blocks would be zeros.
        raise NoSharedRegionError(
            "this service has no shared region, so a sidecar client cannot write blocks: "
            "start it with --shared-region, or upload the bytes with PUT /v1/blocks"
        )
    body, keys = await parse_keys(await request.body(), PrepareRequest, config.max_keys_per_request)
    engine = engine_of(request)
    remember_block_tokens(engine, body, keys)
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


@router.post(
    "/store/complete",
    response_model=StoreCompleted,
    openapi_extra=json_body(StoreCompleteRequest),
)
async def complete_store(request: Request) -> FastJSONResponse:
    """Make the lease's blocks loadable, or roll them back with ``success: false``."""
    body = await parse_body(request, StoreCompleteRequest)
    keys = await engine_of(request).complete_store(
        body.lease_id, body.success, body.transfer_bytes, body.transfer_seconds
    )
    return FastJSONResponse({"lease_id": body.lease_id, "keys": hex_keys(keys)})


@router.post("/load/prepare", response_model=LoadLeaseOut, openapi_extra=json_body(PrepareRequest))
async def prepare_load(request: Request) -> FastJSONResponse:
    """Pin ready blocks for reading under a lease; 409 if any is not ready."""
    raw = await request.body()
    body, keys = await parse_keys(raw, PrepareRequest, config_of(request).max_keys_per_request)
    lease = await engine_of(request).prepare_load(keys, request_context(body), ttl_s=body.ttl_s)
    return FastJSONResponse(
        {
            "lease_id": lease.lease_id,
            "keys": hex_keys(lease.keys),
            "block_ids": [int(b) for b in lease.block_ids],
            "expires_at": lease.expires_at,
        }
    )


@router.post(
    "/load/complete", response_model=LoadCompleted, openapi_extra=json_body(LoadCompleteRequest)
)
async def complete_load(request: Request) -> FastJSONResponse:
    """Unpin the lease's blocks."""
    body = await parse_body(request, LoadCompleteRequest)
    await engine_of(request).complete_load(
        body.lease_id, body.transfer_bytes, body.transfer_seconds
    )
    return FastJSONResponse({"lease_id": body.lease_id})
