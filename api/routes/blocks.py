"""Block bytes over HTTP for clients without the shared region (remote mode)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request
from starlette.responses import Response

from kvcache_offload.aio.types import StoreResult
from kvcache_offload.aio.wire import to_wire
from kvcache_offload.contracts.offload_key import OffloadKey

from ..deps import config_of, engine_of
from ..limits import RequestLimitError, check_key_count
from ..responses import FastJSONResponse
from ..schemas import HexKey

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["blocks"])


_BINARY = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}


@router.put(
    "/blocks",
    response_model=StoreResult,
    openapi_extra={"requestBody": {"required": True, "content": _BINARY}},
)
async def put_blocks(
    request: Request,
    keys: Annotated[
        list[HexKey],
        Query(
            min_length=1, description="Keys in body order; the body is their blocks back to back."
        ),
    ],
) -> FastJSONResponse:
    """Store blocks from the body: exactly ``len(keys) * block_nbytes`` bytes."""
    check_key_count(len(keys), config_of(request).max_keys_per_request)
    engine = engine_of(request)
    page = engine.block_nbytes
    expected = page * len(keys)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) != expected:
        raise RequestLimitError(
            422, f"body must be {len(keys)} x {page} = {expected} bytes, got {declared}"
        )
    body = await request.body()
    if len(body) != expected:
        raise RequestLimitError(
            422, f"body must be {len(keys)} x {page} = {expected} bytes, got {len(body)}"
        )
    view = memoryview(body)
    blocks = [view[i * page : (i + 1) * page] for i in range(len(keys))]  # no second copy
    result = await engine.write_blocks([OffloadKey(bytes.fromhex(k)) for k in keys], blocks)
    return FastJSONResponse(to_wire(result))


@router.get(
    "/blocks/{key}",
    response_class=Response,
    responses={200: {"content": _BINARY, "description": "The block's bytes."}},
)
async def get_block(request: Request, key: Annotated[HexKey, Path()]) -> Response:
    """The bytes of one ready block (409 when it is absent or still being written)."""
    data = await engine_of(request).read_block(OffloadKey(bytes.fromhex(key)))
    return Response(content=data, media_type="application/octet-stream")
