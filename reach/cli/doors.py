"""The options every HTTP gateway takes for its door (``reach.http.guard``) and its
callers' login (``reach.http.oauth``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

__all__ = ["door_options", "policy_of"]

F = TypeVar("F", bound=Callable[..., Any])


def door_options(func: F) -> F:
    """``--no-login``, ``--allow-host``, ``--allow-origin`` and ``--max-body``."""
    options = [
        click.option(
            "--no-login",
            is_flag=True,
            help="serve without the callers' login (127.0.0.1 only): every caller on this"
            " machine then calls with this gateway's credential",
        ),
        click.option(
            "--allow-host",
            "allow_hosts",
            multiple=True,
            metavar="NAME",
            help="a name requests may give in Host besides the loopback names (repeatable)",
        ),
        click.option(
            "--allow-origin",
            "allow_origins",
            multiple=True,
            metavar="ORIGIN",
            help="a web origin (https://app.example) whose pages may call (repeatable)",
        ),
        click.option(
            "--max-body",
            type=click.IntRange(min=1),
            default=1024 * 1024,
            show_default=True,
            metavar="BYTES",
            help="the largest request body taken (413 beyond)",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def policy_of(
    host: str, allow_hosts: tuple[str, ...], allow_origins: tuple[str, ...], max_body: int
) -> Any:
    """The door of a gateway listening on ``host``; a usage error for a bad origin."""
    from reach.http.guard import DoorPolicy
    from reach.http.oauth import TOKEN_PATH

    try:
        return DoorPolicy.for_address(
            host,
            allowed_hosts=allow_hosts,
            origins=allow_origins,
            form_paths=[TOKEN_PATH],
            max_body=max_body,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
