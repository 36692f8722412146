"""Sidecar mode: prepare a store or load, copy through the shared region, then complete it."""

from __future__ import annotations

from fastapi import APIRouter, Request

from kvcache_offload.aio.types import LoadLease, StoreLease
from kvcache_offload.aio.wire import to_wire
from kvcache_offload.errors import NoSharedRegionError

from ..deps import config_of, engine_of
from ..responses import FastJSONResponse
from ..schemas import (
    LoadCompleted,
    LoadCompleteRequest,
    PrepareRequest,
    StoreCompleted,
    StoreCompleteRequest,
)
from ._body import json_body, parse_body
from ._keys import hex_keys, parse_keys, remember_block_tokens, request_context

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["leases"])


@router.post("/store/prepare", response_model=StoreLease, openapi_extra=json_body(PrepareRequest))
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
    await remember_block_tokens(engine, body, keys)
    lease = await engine.prepare_store(keys, request_context(body), ttl_s=body.ttl_s)
    return FastJSONResponse(to_wire(lease))


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


@router.post("/load/prepare", response_model=LoadLease, openapi_extra=json_body(PrepareRequest))
async def prepare_load(request: Request) -> FastJSONResponse:
    """Pin ready blocks for reading under a lease; 409 if any is not ready."""
    raw = await request.body()
    body, keys = await parse_keys(raw, PrepareRequest, config_of(request).max_keys_per_request)
    lease = await engine_of(request).prepare_load(keys, request_context(body), ttl_s=body.ttl_s)
    return FastJSONResponse(to_wire(lease))


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
