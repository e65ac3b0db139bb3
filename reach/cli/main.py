"""``reach``: the command group; subcommands register themselves here."""

from __future__ import annotations

import click

from reach.cli.common import CommandGroup


@click.group(cls=CommandGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="log more (-vv for debug)")
@click.version_option(package_name="agent-reach")
def main(verbose: int) -> None:
    """Agent-Reach: make AI agents reliably reachable by each other over NATS."""
    import logging

    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _register() -> None:
    # Imported here so each command module stays independent of the others.
    from reach.cli import (
        a2a,
        agents,
        alerts,
        audit,
        call,
        console,
        creds,
        demo,
        doctor,
        jobs,
        mcp,
        natsauth,
        top,
        up,
        validate,
    )

    for module in (
        a2a,
        agents,
        alerts,
        audit,
        call,
        console,
        creds,
        demo,
        doctor,
        jobs,
        mcp,
        natsauth,
        top,
        up,
        validate,
    ):
        module.register(main)


_register()
