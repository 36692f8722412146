"""``GET /v1/events``: the engine's event stream as server-sent events, resumable."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from sse_starlette import EventSourceResponse

from kvcache_offload.aio.types import EventType
from kvcache_offload.errors import ConfigError

from ..broadcast import EventBroadcaster
from ..deps import config_of, engine_of
from ..errors import TooManySubscribers
from ..sse import parse_event_id

__all__ = ["broadcaster_of", "router"]

router = APIRouter(prefix="/v1", tags=["events"])

_TYPES = ", ".join(t.value for t in EventType)


def _parse_types(raw: list[str] | None) -> list[EventType] | None:
    if not raw:
        return None
    names = [n.strip() for part in raw for n in part.split(",") if n.strip()]
    try:
        return [EventType(n) for n in names] or None
    except ValueError:
        raise ConfigError(f"unknown event type in {names}: expected some of {_TYPES}") from None


def broadcaster_of(request: Request) -> EventBroadcaster:
    """The app's broadcaster over its current engine's event hub (made on first use)."""
    hub = engine_of(request).event_hub
    state = request.app.state
    broadcaster: EventBroadcaster | None = state.broadcaster
    if broadcaster is None or broadcaster.hub is not hub:
        broadcaster = EventBroadcaster(hub)
        state.broadcaster = broadcaster
    return broadcaster


@router.get(
    "/events",
    response_class=EventSourceResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "SSE stream."}},
)
async def events(
    request: Request,
    types: Annotated[
        list[str] | None, Query(description=f"Only these event types ({_TYPES}), comma-separated.")
    ] = None,
    last_event_id: Annotated[
        str | None, Query(max_length=64, description="Resume after this sequence number.")
    ] = None,
    last_event_id_header: Annotated[
        str | None, Header(alias="Last-Event-ID", max_length=64, include_in_schema=False)
    ] = None,
) -> EventSourceResponse:
    """Live events; ``Last-Event-ID`` (header) or ``last_event_id`` (query) replays newer ones.

    A ``gap`` event (data: ``missed``, ``next_seq``) replaces events this client missed; an
    id from another run of the service (it restarted) replays this run's events from the
    start, after a ``gap`` event with ``restarted: true``.
    """
    raw = last_event_id_header or last_event_id
    wanted = _parse_types(types)
    broadcaster = broadcaster_of(request)
    since: int | None = None
    restarted = False
    if raw:
        since, restarted = broadcaster.resume_point(*parse_event_id(raw))
    config = config_of(request)
    if broadcaster.subscribers >= config.max_event_subscribers:
        raise TooManySubscribers(
            f"{broadcaster.subscribers} event streams are open, the most allowed "
            f"(max_event_subscribers={config.max_event_subscribers}); retry later"
        )
    return EventSourceResponse(
        broadcaster.stream(wanted, since, restarted),
        ping=config.sse_heartbeat_s,
        send_timeout=config.sse_send_timeout_s,  # a client that stops reading is dropped
    )
