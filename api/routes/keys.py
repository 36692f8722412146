"""Lookup and touch: which prefix of a request is offloaded, and keeping it warm."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.datastructures import State

from api.responses import FastJSONResponse
from api.routes._body import json_body
from api.routes._keys import hex_keys, parse_keys, request_context
from api.routes._state import config_of, engine_of, state_config, state_engine
from api.schemas import KeysRequest, LookupOut, Touched

__all__ = ["LOOKUP_PATH", "lookup_answer", "router"]

router = APIRouter(prefix="/v1", tags=["keys"])

LOOKUP_PATH = "/v1/lookup"


async def lookup_answer(state: State, raw_body: bytes) -> dict[str, Any]:
    """The lookup response for a raw JSON body (shared with the fast path in api/hot_path.py)."""
    body, keys = await parse_keys(raw_body, KeysRequest, state_config(state).max_keys_per_request)
    result = await state_engine(state).lookup(keys, request_context(body))
    out: dict[str, Any] = {"hits": result.hits, "pending": result.pending, "states": result.states}
    if result.tiers is not None:
        out["tiers"] = result.tiers
    if body.token_ids is not None:
        out["keys"] = hex_keys(keys)
    return out


@router.post(
    "/lookup",
    response_model=LookupOut,
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
