"""``GET /metrics`` in the Prometheus text format."""

from __future__ import annotations

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

__all__ = ["router"]

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text."}},
)
async def metrics(request: Request) -> Response:
    """Every metric of docs/metrics.md."""
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)
