"""Options every command takes, and the one place CLI errors become exit codes.

The command modules import this one, and ``reach --help`` imports every command module:
what a command needs to run (NATS, the security stack, the wire models, rich) is
imported inside the function that runs it, so that listing the commands, or running
one, does not load the others' (tests/test_cli_imports.py keeps it so)."""

from __future__ import annotations

import contextlib
import difflib
import functools
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from reach.errors import ConfigurationError, ReachError
from reach.settings import DEFAULT_STORE, resolve_credentials, resolve_servers

if TYPE_CHECKING:
    from rich.console import Console

    from reach.transport import Connection

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


class CommandGroup(click.Group):
    """A group whose unknown command is answered with the commands closest to it."""

    #: the groups made with ``@group.group()`` are of this class too
    group_class = type

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name = args[0] if args else ""
        if name and not name.startswith("-") and self.get_command(ctx, name) is None:
            close = difflib.get_close_matches(name, self.list_commands(ctx), n=3, cutoff=0.6)
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            ctx.fail(f"No such command {name!r}.{hint}")
        return super().resolve_command(ctx, args)


@dataclass(frozen=True)
class Target:
    """Where a command connects: ``--servers`` / ``--creds`` or their defaults."""

    servers: list[str]
    credentials: Path | None


def wait_option(help_text: str) -> Callable[[F], F]:
    """``--wait [SECONDS]``: wait for a job's result, at most SECONDS (without a value,
    0: as long as it takes)."""
    return click.option(
        "--wait",
        type=float,
        default=None,
        is_flag=False,
        flag_value=0.0,
        metavar="[SECONDS]",
        help=help_text,
    )


def connection_options(func: F) -> F:
    """Add ``--servers URL`` and ``--creds FILE`` and pass a ``target: Target``."""

    @click.option(
        "--servers",
        metavar="URL",
        default=None,
        help="NATS URL(s), comma separated [env REACH_URL; default nats://127.0.0.1:4222]",
    )
    @click.option(
        "--creds",
        metavar="FILE",
        default=None,
        type=click.Path(dir_okay=False),
        help="credentials file [env REACH_CREDS; default .reach/dev.creds if present]",
    )
    @functools.wraps(func)
    def wrapper(*args: Any, servers: str | None, creds: str | None, **kwargs: Any) -> Any:
        credentials = resolve_credentials(creds)
        target = Target(resolve_servers(servers, credentials), credentials)
        return func(*args, target=target, **kwargs)

    return wrapper  # type: ignore[return-value]


def store_option(help: str) -> Callable[[F], F]:
    """``--store DIR`` (default .reach): the directory of a fabric's secrets and state."""
    return click.option(
        "--store",
        type=click.Path(file_okay=False, path_type=Path),
        default=DEFAULT_STORE,
        show_default=True,
        help=help,
    )


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a command's coroutine; a ReachError becomes a one-line reason and exit code 1."""
    import asyncio

    try:
        return asyncio.run(coro)
    except ConfigurationError as exc:
        fail(str(exc), code=2)
    except ReachError as exc:
        fail(f"{type(exc).__name__}: {exc}")
    except KeyboardInterrupt:
        sys.exit(130)


def fail(message: str, code: int = 1) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


@contextlib.asynccontextmanager
async def connection(target: Target, name: str) -> AsyncIterator[Connection]:
    """A plain NATS connection for an operator command (the credentials' identity)."""
    from reach.security.membership import connect_as

    conn, _ = await connect_as(target.servers, name=name, credentials=target.credentials)
    try:
        yield conn
    finally:
        await conn.close()


#: a table printed to a pipe or file is as wide as it needs (one line per row, greppable)
PIPED_WIDTH = 1000


def console() -> Console:
    """Where tables go: the terminal's width on a terminal; unwrapped when piped."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=PIPED_WIDTH)


def colour_wanted() -> bool:
    """Colour on a terminal, plain when piped (and never with NO_COLOR set)."""
    import os

    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")
