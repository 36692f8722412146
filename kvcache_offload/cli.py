"""The ``kvcache-offload`` command line: one typer app, each command defined in its own module."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer

from kvcache_offload._registry import LazyRegistry
from kvcache_offload.errors import ConfigError

__all__ = ["COMMANDS", "app", "main"]


def _command(obj: object, name: str) -> Callable[..., Any]:
    if not callable(obj):
        raise ConfigError(f"command {name!r} resolves to {obj!r}, which is not callable")
    return obj


COMMANDS: LazyRegistry[Callable[..., Any]] = LazyRegistry("command", _command, ConfigError)
COMMANDS.register("serve", "kvcache_offload_service.cli:serve")
COMMANDS.register("replay", "kvcache_offload.lab.cli:replay")

app = typer.Typer(
    name="kvcache-offload",
    help="Offload LLM KV-cache blocks to CPU memory: serve the HTTP API, replay traces.",
    no_args_is_help=True,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        from kvcache_offload import __version__

        typer.echo(f"kvcache-offload {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """Offload LLM KV-cache blocks to CPU memory: serve the HTTP API, replay traces."""


for _name in COMMANDS.names():
    app.command(_name)(COMMANDS.get(_name))


def main() -> None:
    app()
