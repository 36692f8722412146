"""Lookup and touch: which prefix of a request is offloaded, and keeping it warm."""

from __future__ import annotations

from fastapi import APIRouter, Request

from api.responses import FastJSONResponse
from api.routes._body import json_body, parse_body
from api.routes._keys import hex_keys, request_context, resolve_keys
from api.routes._state import config_of, engine_of
from api.schemas import KeysRequest, LookupOut, Touched

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["keys"])


@router.post(
    "/lookup",
    response_model=LookupOut,
    response_model_exclude_none=True,
    openapi_extra=json_body(KeysRequest),
)
async def lookup(request: Request) -> FastJSONResponse:
    """Length of the longest ready prefix and the state of every key."""
    body = await parse_body(request, KeysRequest)
    keys = resolve_keys(body, config_of(request).max_keys_per_request)
    result = await engine_of(request).lookup(keys, request_context(body))
    out: dict[str, object] = {
        "hits": result.hits,
        "pending": result.pending,
        "states": result.states,
    }
    if body.token_ids is not None:
        out["keys"] = hex_keys(keys)
    return FastJSONResponse(out)


@router.post("/touch", response_model=Touched, openapi_extra=json_body(KeysRequest))
async def touch(request: Request) -> FastJSONResponse:
    """Mark blocks recently used (the first key ends up most recently used)."""
    body = await parse_body(request, KeysRequest)
    keys = resolve_keys(body, config_of(request).max_keys_per_request)
    await engine_of(request).touch(keys, request_context(body))
    return FastJSONResponse({"touched": len(keys)})
