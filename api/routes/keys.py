"""Lookup and touch: which prefix of a request is offloaded, and keeping it warm."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from api.deps import EngineLike, get_config, get_engine
from api.responses import FastJSONResponse
from api.routes._keys import hex_keys, request_context, resolve_keys
from api.schemas import KeysRequest, LookupOut, Touched
from kvcache_offload.config import OffloadConfig

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["keys"])

Engine = Annotated[EngineLike, Depends(get_engine)]
Config = Annotated[OffloadConfig, Depends(get_config)]


@router.post("/lookup", response_model=LookupOut, response_model_exclude_none=True)
async def lookup(body: KeysRequest, engine: Engine, config: Config) -> FastJSONResponse:
    """Length of the longest ready prefix and the state of every key."""
    keys = resolve_keys(body, config.max_keys_per_request)
    result = await engine.lookup(keys, request_context(body))
    out: dict[str, object] = {
        "hits": result.hits,
        "pending": result.pending,
        "states": [str(s) for s in result.states],
    }
    if body.token_ids is not None:
        out["keys"] = hex_keys(keys)
    return FastJSONResponse(out)


@router.post("/touch", response_model=Touched)
async def touch(body: KeysRequest, engine: Engine, config: Config) -> FastJSONResponse:
    """Mark blocks recently used (the first key ends up most recently used)."""
    keys = resolve_keys(body, config.max_keys_per_request)
    await engine.touch(keys, request_context(body))
    return FastJSONResponse({"touched": len(keys)})
