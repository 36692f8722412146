"""The one place where errors become HTTP statuses; every error body is ``{error, detail}``."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from kvcache_offload import errors as lib

from .limits import RequestLimitError
from .responses import FastJSONResponse

__all__ = [
    "STATUS_BY_ERROR",
    "EngineNotReady",
    "TooManySubscribers",
    "error_response",
    "install_error_handlers",
    "status_for",
]


class TooManySubscribers(lib.OffloadError):
    """Every event-stream slot is taken (``max_event_subscribers``): retry later."""


class EngineNotReady(lib.OffloadError):
    """The app's engine is not started (lifespan not run) or already closed: retry later."""


logger = logging.getLogger(__name__)

STATUS_BY_ERROR: dict[type[lib.OffloadError], int] = {
    lib.ConfigError: 422,
    lib.InvalidKeyError: 422,
    lib.BlockStateError: 409,
    lib.CapacityError: 507,
    lib.LeaseError: 404,
    lib.LeaseExpiredError: 410,
    lib.TransferError: 502,
    lib.RegionError: 503,
    lib.NoSharedRegionError: 409,
    lib.LeaseLimitError: 429,
    TooManySubscribers: 503,
    EngineNotReady: 503,
}
"""Most specific class wins (the MRO is walked); anything else under OffloadError is 400.
A :class:`RequestLimitError` carries its own status (408, 413, 422, 429, 503)."""

_RETRY_LATER = {"Retry-After": "1"}

_BAD_KEY = (
    "an offload key is hex: the block hash bytes then the 4-byte big-endian group index, "
    "10 to 264 hex digits (e.g. '000000000000002a00000000')"
)

_LIMIT_ERROR_NAMES = {408: "RequestTimeout", 413: "RequestTooLarge", 429: "TooManyRequests"}


def _readable(error: Mapping[str, object]) -> str:
    """pydantic's message, except a regex mismatch (only keys have one) says what a key is."""
    if error.get("type") == "string_pattern_mismatch":
        return _BAD_KEY
    return str(error.get("msg", ""))


def status_for(exc: lib.OffloadError) -> int:
    """HTTP status of a library error; an expired lease is 410 Gone, an unknown one 404."""
    if isinstance(exc, RequestLimitError):
        return exc.status
    for cls in type(exc).__mro__:
        status = STATUS_BY_ERROR.get(cls)
        if status is not None:
            return status
    return 400


def _body(
    error: str, detail: object, status: int, headers: Mapping[str, str] | None = None
) -> Response:
    return FastJSONResponse({"error": error, "detail": detail}, status_code=status, headers=headers)


def error_response(exc: BaseException) -> Response | None:
    """The JSON error response for ``exc``, or None when it is not an expected error."""
    if isinstance(exc, RequestLimitError):
        name = _LIMIT_ERROR_NAMES.get(exc.status, "InvalidRequest")
        return _body(name, exc.message, exc.status)
    if isinstance(exc, lib.OffloadError):
        headers = _RETRY_LATER if isinstance(exc, EngineNotReady) else None
        return _body(type(exc).__name__, str(exc), status_for(exc), headers)
    if isinstance(exc, RequestValidationError):
        errors = [
            {"loc": list(e.get("loc", ())), "msg": _readable(e), "type": e.get("type", "")}
            for e in exc.errors()
        ]
        return _body("ValidationError", errors, 422)
    if isinstance(exc, HTTPException):
        name = "Unauthorized" if exc.status_code == 401 else "HTTPError"
        return _body(name, exc.detail, exc.status_code, exc.headers)
    return None


async def _handle(request: Request, exc: Exception) -> Response:
    response = error_response(exc)
    if response is None:  # only registered for the classes error_response knows
        raise exc
    return response


async def _client_gone(request: Request, exc: Exception) -> Response:
    """The client disconnected (or shutdown cut its body short): nobody reads an answer."""
    return Response(status_code=499)


async def _unexpected(request: Request, exc: Exception) -> Response:
    """A bug or an exhausted host (e.g. MemoryError): still the documented JSON body.

    Starlette logs the traceback after this handler answers.
    """
    return _body("InternalError", f"{type(exc).__name__}: {exc}"[:500], 500)


def install_error_handlers(app: FastAPI) -> None:
    """Register every mapping on ``app``; anything unexpected is a JSON 500."""
    for cls in (lib.OffloadError, RequestValidationError):
        app.add_exception_handler(cls, _handle)
    app.add_exception_handler(HTTPException, _handle)
    app.add_exception_handler(ClientDisconnect, _client_gone)
    app.add_exception_handler(Exception, _unexpected)
