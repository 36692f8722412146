"""The ``kvcache-offload`` command line: one typer app, each command defined in its own module.

Command modules load only when their command runs (or its help is shown), so the base install
(no extras) runs ``--help``, ``--version`` and ``replay``. A command whose extra is missing
says which extra to install, in one line, instead of a traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer
from typer.core import TyperGroup

from kvcache_offload._registry import LazyRegistry
from kvcache_offload.errors import ConfigError
from kvcache_offload.extras import extra_for_module, missing_extra_message

__all__ = ["COMMANDS", "app", "main"]


def _command(obj: object, name: str) -> Callable[..., Any]:
    if not callable(obj):
        raise ConfigError(f"command {name!r} resolves to {obj!r}, which is not callable")
    return obj


COMMANDS: LazyRegistry[Callable[..., Any]] = LazyRegistry("command", _command, ConfigError)
COMMANDS.register("serve", "kvcache_offload_service.cli:serve")
COMMANDS.register("replay", "kvcache_offload.lab.cli:replay")

_SUMMARIES = {
    "serve": "Serve the HTTP API: lookup/store/load, block bytes, events, /metrics.",
    "replay": "Replay request traces through each eviction policy, next to Belady.",
}
"""One-line help for the command list, so listing the commands imports none of them."""


def _typer_command(name: str, function: Callable[..., Any], **settings: Any) -> Any:
    """``function`` as the (click) command typer builds for it."""
    one = typer.Typer(add_completion=False, rich_markup_mode=None)
    one.command(name, **settings)(function)
    command = typer.main.get_command(one)
    command.name = name
    return command


def _unavailable(name: str, message: str) -> Any:
    """A stand-in for a command that cannot load: any invocation prints ``message``."""

    def fail() -> None:
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(1)

    return _typer_command(
        name,
        fail,
        help=message,
        add_help_option=False,
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    )


class _LazyGroup(TyperGroup):
    """Loads a command's module when the command is resolved, not at start. (typer carries
    its own click, so the types here stay ``Any``: no second click is needed.)"""

    def list_commands(self, ctx: Any) -> list[str]:
        return sorted(COMMANDS.names())

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in COMMANDS.names():
            return None
        try:
            function = COMMANDS.get(cmd_name)
        except ConfigError as exc:  # the command's module failed to import
            missing = exc.__cause__
            module = missing.name if isinstance(missing, ModuleNotFoundError) else None
            extra = extra_for_module(module) if module else None
            message = missing_extra_message(cmd_name, extra, module) if extra and module else exc
            return _unavailable(cmd_name, str(message))
        return _typer_command(cmd_name, function)

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        rows = [(name, _SUMMARIES.get(name, "")) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


app = typer.Typer(
    name="kvcache-offload",
    help="Offload LLM KV-cache blocks to CPU memory: serve the HTTP API, replay traces.",
    cls=_LazyGroup,
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
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


def main() -> None:
    app()
