"""The ``kvcache-offload`` command line: one typer app, each command defined in its own module."""

from __future__ import annotations

import typer

from kvcache_offload._imports import import_object

__all__ = ["app", "main"]

_COMMANDS = {
    "serve": "api.cli:serve",
    "replay": "kvcache_offload.replay.cli:replay",
}

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


for _name, _path in _COMMANDS.items():
    app.command(_name)(import_object(_path))  # type: ignore[arg-type,type-var]


def main() -> None:
    app()
