"""``reach demo``: the seed scenario on a secured embedded fabric (see reach/demo)."""

from __future__ import annotations

import asyncio
import sys

import click

from reach.cli.common import Target, connection_options


def register(main: click.Group) -> None:
    @main.command("demo")
    @click.option(
        "--duration",
        type=click.FloatRange(5, 600),
        default=24.0,
        show_default=True,
        help="seconds of scheduled calls",
    )
    @click.option(
        "--rate",
        type=click.FloatRange(1, 1000),
        default=40.0,
        show_default=True,
        help="scheduler calls per second",
    )
    @connection_options
    def demo(target: Target, duration: float, rate: float) -> None:
        """Scheduler → industry report → data query ×2: saturation, a kill, a replacement.

        Runs on a fabric of its own, secured as `reach up` secures it (an embedded
        nats-server on a free port, a temporary store, credentials for each participant);
        the --servers/--creds options are accepted for uniformity and not used.
        """
        from reach.demo import run_demo

        failed = asyncio.run(run_demo(duration=duration, rate=rate))
        sys.exit(1 if failed else 0)
