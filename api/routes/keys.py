"""Lookup, touch and discard: which prefix of a request is offloaded, keeping it warm, and
letting a finished session's blocks go."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from starlette.datastructures import State

from kvcache_offload.aio.types import LookupResult
from kvcache_offload.aio.wire import to_wire

from ..deps import config_of, engine_of
from ..responses import FastJSONResponse
from ..schemas import Discarded, KeysRequest, Released, Touched
from ._body import json_body
from ._keys import parse_keys, request_context

__all__ = ["LOOKUP_PATH", "lookup_answer", "router"]

router = APIRouter(prefix="/v1", tags=["keys"])

LOOKUP_PATH = "/v1/lookup"


async def lookup_answer(state: State, raw_body: bytes) -> dict[str, Any]:
    """The lookup response for a raw JSON body (shared with the fast path in api/hot_path.py)."""
    body, keys = await parse_keys(raw_body, KeysRequest, config_of(state).max_keys_per_request)
    result = await engine_of(state).lookup(keys, request_context(body))
    if body.token_ids is not None:
        result = replace(result, keys=keys)
    out: dict[str, Any] = to_wire(result, exclude_none=True)
    return out


@router.post(
    "/lookup",
    response_model=LookupResult,
    response_model_exclude_none=True,
    openapi_extra=json_body(KeysRequest),
)
async def lookup(request: Request) -> FastJSONResponse:
    """Length of the longest ready prefix and the state of every key."""
    return FastJSONResponse(await lookup_answer(request.app.state, await request.body()))


@router.post("/touch", response_model=Touched, openapi_extra=json_body(KeysRequest))
async def touch(request: Request) -> FastJSONResponse:
    """Mark blocks recently used (the first key ends up most recently used)."""
    raw = await request.body()
    body, keys = await parse_keys(raw, KeysRequest, config_of(request).max_keys_per_request)
    await engine_of(request).touch(keys, request_context(body))
    return FastJSONResponse({"touched": len(keys)})


@router.post("/discard", response_model=Discarded, openapi_extra=json_body(KeysRequest))
async def discard(request: Request) -> FastJSONResponse:
    """Free blocks nobody will ask for again (a finished session's own keys)."""
    raw = await request.body()
    _, keys = await parse_keys(raw, KeysRequest, config_of(request).max_keys_per_request)
    dropped = await engine_of(request).discard(keys)
    return FastJSONResponse({"discarded": [key.hex() for key in dropped]})


@router.post("/release", response_model=Released, openapi_extra=json_body(KeysRequest))
async def release(request: Request) -> FastJSONResponse:
    """Evict these blocks first when room is needed, unless asked for again (a session that
    probably ended)."""
    raw = await request.body()
    _, keys = await parse_keys(raw, KeysRequest, config_of(request).max_keys_per_request)
    return FastJSONResponse({"released": await engine_of(request).release(keys)})
