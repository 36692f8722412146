"""``kvcache-offload serve``: run the HTTP service with uvicorn.

Settings come from flags, then ``KVCACHE_OFFLOAD_*`` environment variables, then the config
file, then defaults. With no arguments it serves an embedded CPU-only engine on 127.0.0.1:8000.
Ctrl-C / SIGTERM drain open requests, then the lifespan closes the engine and its region.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Annotated, Any

import typer

from kvcache_offload.config import OffloadConfig, load_config
from kvcache_offload.errors import OffloadError
from kvcache_offload.extras import require

__all__ = ["build_config", "serve"]

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def build_config(config_file: Path | None = None, **flags: Any) -> OffloadConfig:
    """Config from the file, environment and the flags that were actually given. A setting
    given by its old name works and is reported on stderr, once per name (Python hides
    ``DeprecationWarning`` outside ``__main__``)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        config = load_config(config_file, **{k: v for k, v in flags.items() if v is not None})
    for message in dict.fromkeys(
        str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)
    ):
        typer.echo(f"warning: {message}", err=True)
    return config


def serve(
    host: Annotated[str | None, typer.Option(help="Interface to bind (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (default 8000).")] = None,
    config_file: Annotated[
        Path | None,
        typer.Option("--config", "-c", help="TOML, JSON or YAML config file.", exists=True),
    ] = None,
    cpu_bytes: Annotated[
        str | None, typer.Option(help="CPU bytes for offloaded blocks, e.g. 4GiB.")
    ] = None,
    policy: Annotated[
        str | None, typer.Option(help="Eviction policy (default adaptive; lru, arc, ...).")
    ] = None,
    block_size: Annotated[int | None, typer.Option(help="Tokens per offloaded block.")] = None,
    store_threshold: Annotated[
        int | None, typer.Option(help="Store a block only after it was offered this many times.")
    ] = None,
    backend: Annotated[str | None, typer.Option(help="Data plane: auto, cpu or cuda.")] = None,
    shared_region: Annotated[
        bool | None,
        typer.Option(
            "--shared-region/--no-shared-region",
            help="Keep blocks in a /dev/shm region worker processes can map.",
        ),
    ] = None,
    lease_ttl: Annotated[
        float | None, typer.Option(help="Seconds before an uncompleted lease rolls back.")
    ] = None,
    region_name: Annotated[
        str | None,
        typer.Option(help="Name of the shared region (one per service on a host)."),
    ] = None,
    api_token: Annotated[
        str | None,
        typer.Option(help="Bearer token required on /v1 (prefer KVCACHE_OFFLOAD_API_TOKEN)."),
    ] = None,
    kv_events_endpoint: Annotated[
        str | None,
        typer.Option(help="Publish KV events for routers on this ZMQ endpoint, e.g. tcp://*:5557."),
    ] = None,
    kv_events_replay_endpoint: Annotated[
        str | None, typer.Option(help="ZMQ endpoint answering KV-event replay requests.")
    ] = None,
    kv_events_topic: Annotated[
        str | None, typer.Option(help="Topic frame of every KV-event message.")
    ] = None,
    remote_url: Annotated[
        str | None,
        typer.Option(help="Redis/Valkey tier: redis://HOST:PORT/DB, rediss://, redis+cluster://."),
    ] = None,
    disk_path: Annotated[Path | None, typer.Option(help="Disk tier directory.")] = None,
    disk_bytes: Annotated[str | None, typer.Option(help="Disk tier budget, e.g. 100GiB.")] = None,
    object_url: Annotated[
        str | None,
        typer.Option(help="Object-store tier: s3://BUCKET/PREFIX, gs://, az://, file:///PATH."),
    ] = None,
    object_endpoint: Annotated[
        str | None,
        typer.Option(help="S3-compatible endpoint for an s3:// object URL, e.g. http://HOST:9000."),
    ] = None,
    object_bytes: Annotated[
        str | None,
        typer.Option(help="Object tier budget, e.g. 2TiB (default: the bucket's lifecycle rules)."),
    ] = None,
    object_concurrency: Annotated[
        int | None, typer.Option(help="Object tier requests in flight per direction (16).")
    ] = None,
    model_id: Annotated[
        str | None, typer.Option(help="Model name: only instances with the same one share tiers.")
    ] = None,
    tier_write: Annotated[
        str | None, typer.Option(help="through (default) or back: when blocks go below the CPU.")
    ] = None,
    tier_write_backpressure: Annotated[
        bool | None,
        typer.Option(
            "--tier-write-backpressure/--no-tier-write-backpressure",
            help="Stores wait for room in the tier write queue instead of dropping the write.",
        ),
    ] = None,
    tier_write_backpressure_timeout: Annotated[
        float | None, typer.Option(help="Longest a store waits for that room, in seconds.")
    ] = None,
    log_level: Annotated[str, typer.Option(help=f"One of {', '.join(_LOG_LEVELS)}.")] = "info",
    access_log: Annotated[bool, typer.Option(help="Log every request.")] = False,
) -> None:
    """Serve lookup/store/load, block bytes, server-sent events and /metrics over HTTP."""
    if log_level.lower() not in _LOG_LEVELS:
        raise typer.BadParameter(f"expected one of {_LOG_LEVELS}", param_hint="--log-level")
    try:
        require("server", "kvcache-offload serve")
        config = build_config(
            config_file,
            host=host,
            port=port,
            cpu_bytes_to_use=cpu_bytes,
            eviction_policy=policy,
            block_size=block_size,
            store_threshold=store_threshold,
            backend=backend,
            shared_region=shared_region,
            lease_ttl_s=lease_ttl,
            region_name=region_name,
            api_token=api_token,
            kv_events_endpoint=kv_events_endpoint,
            kv_events_replay_endpoint=kv_events_replay_endpoint,
            kv_events_topic=kv_events_topic,
            remote_url=remote_url,
            disk_path=disk_path,
            disk_bytes=disk_bytes,
            object_url=object_url,
            object_endpoint=object_endpoint,
            object_bytes=object_bytes,
            object_concurrency=object_concurrency,
            model_id=model_id,
            tier_write=tier_write,
            tier_write_backpressure=tier_write_backpressure,
            tier_write_backpressure_timeout_s=tier_write_backpressure_timeout,
        )
        from .startup import preflight

        preflight(config)
    except OffloadError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    from .app import create_app
    from .heap import FrozenStartupHeap
    from .startup import OneLineStartupErrors

    logging.basicConfig(level=log_level.upper() if log_level != "trace" else "DEBUG")
    app = create_app(config)
    guarded = OneLineStartupErrors(app)
    try:
        _run(FrozenStartupHeap(guarded), app, config, log_level, access_log)
    except SystemExit:
        if guarded.failed is not None:  # the one-line reason is already logged
            raise typer.Exit(2) from None
        raise


def _run(asgi: Any, app: Any, config: OffloadConfig, log_level: str, access_log: bool) -> None:
    import uvicorn
    from sse_starlette.sse import AppStatus

    from .serving import protocol_class

    def end_event_streams() -> None:
        broadcaster = getattr(app.state, "broadcaster", None)
        if broadcaster is not None:
            broadcaster.end_streams()

    # Our drain ends the event streams cleanly; sse-starlette's own would cancel them.
    AppStatus.disable_automatic_graceful_drain()
    uvicorn.run(
        asgi,
        host=config.host,
        port=config.port,
        loop="uvloop",
        http=protocol_class(
            config.header_read_timeout_s, end_event_streams, int(config.max_header_bytes)
        ),
        log_level=log_level.lower(),
        access_log=access_log,
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
