"""``kvcache-offload serve``: run the HTTP service with uvicorn.

Settings come from flags, then ``KVCACHE_OFFLOAD_*`` environment variables, then the config
file, then defaults. With no arguments it serves an embedded CPU-only engine on 127.0.0.1:8000.
Ctrl-C / SIGTERM drain open requests, then the lifespan closes the engine and its region.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NamedTuple

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


class _Flag(NamedTuple):
    """A ``serve`` flag that sets one config field (``None`` when not given: the environment,
    the file or the default decides)."""

    field: str
    help: str
    type: type = str
    name: str = ""
    """The parameter (``--name``) when it is not the field's name."""
    decls: tuple[str, ...] = ()


_CONFIG_FLAGS: tuple[_Flag, ...] = (
    _Flag("host", "Interface to bind (default 127.0.0.1)."),
    _Flag("port", "TCP port (default 8000).", int),
    _Flag("cpu_bytes_to_use", "CPU bytes for offloaded blocks, e.g. 4GiB.", name="cpu_bytes"),
    _Flag("eviction_policy", "Eviction policy (default adaptive; lru, arc, ...).", name="policy"),
    _Flag("block_size", "Tokens per offloaded block.", int),
    _Flag("store_threshold", "Store a block only after it was offered this many times.", int),
    _Flag("backend", "Data plane: auto, cpu or cuda."),
    _Flag(
        "shared_region",
        "Keep blocks in a /dev/shm region worker processes can map.",
        bool,
        decls=("--shared-region/--no-shared-region",),
    ),
    _Flag("lease_ttl_s", "Seconds before an uncompleted lease rolls back.", float, "lease_ttl"),
    _Flag("region_name", "Name of the shared region (one per service on a host)."),
    _Flag("api_token", "Bearer token required on /v1 (prefer KVCACHE_OFFLOAD_API_TOKEN)."),
    _Flag(
        "kv_events_endpoint",
        "Publish KV events for routers on this ZMQ endpoint, e.g. tcp://*:5557.",
    ),
    _Flag("kv_events_replay_endpoint", "ZMQ endpoint answering KV-event replay requests."),
    _Flag("kv_events_topic", "Topic frame of every KV-event message."),
    _Flag("remote_url", "Redis/Valkey tier: redis://HOST:PORT/DB, rediss://, redis+cluster://."),
    _Flag("disk_path", "Disk tier directory.", Path),
    _Flag("disk_bytes", "Disk tier budget, e.g. 100GiB."),
    _Flag("object_url", "Object-store tier: s3://BUCKET/PREFIX, gs://, az://, file:///PATH."),
    _Flag(
        "object_endpoint", "S3-compatible endpoint for an s3:// object URL, e.g. http://HOST:9000."
    ),
    _Flag("object_bytes", "Object tier budget, e.g. 2TiB (default: the bucket's lifecycle rules)."),
    _Flag("object_concurrency", "Object tier requests in flight per direction (16).", int),
    _Flag("model_id", "Model name: only instances with the same one share tiers."),
    _Flag("tier_write", "through (default) or back: when blocks go below the CPU."),
    _Flag(
        "tier_write_backpressure",
        "Stores wait for room in the tier write queue instead of dropping the write.",
        bool,
        decls=("--tier-write-backpressure/--no-tier-write-backpressure",),
    ),
    _Flag(
        "tier_write_backpressure_timeout_s",
        "Longest a store waits for that room, in seconds.",
        float,
        "tier_write_backpressure_timeout",
    ),
)
"""The flags that set config fields, in the order ``--help`` lists them (after ``--config``)."""


def _with_config_flags(command: Callable[..., None]) -> Callable[..., None]:
    """Give ``command`` (which takes them as ``**flags``) one typer option per config flag."""
    own = inspect.signature(command, eval_str=True).parameters.values()
    options = [
        inspect.Parameter(
            flag.name or flag.field,
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=Annotated[flag.type | None, typer.Option(*flag.decls, help=flag.help)],
        )
        for flag in _CONFIG_FLAGS
    ]
    kept = [p for p in own if p.kind is not inspect.Parameter.VAR_KEYWORD]
    # --config first, the config flags, then the serving flags: the order --help shows.
    signature = inspect.Signature([*kept[:1], *options, *kept[1:]], return_annotation=None)
    command.__signature__ = signature  # type: ignore[attr-defined]
    command.__annotations__.update({p.name: p.annotation for p in (*kept, *options)})
    return command


@_with_config_flags
def serve(
    *,
    config_file: Annotated[
        Path | None,
        typer.Option("--config", "-c", help="TOML, JSON or YAML config file.", exists=True),
    ] = None,
    log_level: Annotated[str, typer.Option(help=f"One of {', '.join(_LOG_LEVELS)}.")] = "info",
    access_log: Annotated[bool, typer.Option(help="Log every request.")] = False,
    **flags: Any,
) -> None:
    """Serve lookup/store/load, block bytes, server-sent events and /metrics over HTTP."""
    if log_level.lower() not in _LOG_LEVELS:
        raise typer.BadParameter(f"expected one of {_LOG_LEVELS}", param_hint="--log-level")
    try:
        require("server", "kvcache-offload serve")
        config = build_config(
            config_file,
            **{flag.field: flags.get(flag.name or flag.field) for flag in _CONFIG_FLAGS},
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
