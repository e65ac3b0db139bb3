"""``reach demo``: the seed scenario on a secured embedded fabric (see reach/demo)."""

from __future__ import annotations

import sys

import click


def register(main: click.Group) -> None:
    @main.command("demo", short_help="Run the seed scenario on a fabric of its own.")
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
    @click.option(
        "--keep/--no-keep",
        default=None,
        help="keep the fabric up after the run, for `reach audit tail` and the other"
        " commands, until Enter [default: on a terminal]",
    )
    def demo(duration: float, rate: float, keep: bool | None) -> None:
        """Scheduler → industry report → data query ×2: saturation, a kill, a replacement.

        Runs on a fabric of its own, secured as `reach up` secures it (an embedded
        nats-server on a free port, a temporary store, credentials for each
        participant). On a terminal the fabric stays up after the summary, with the
        commands that look into it (`reach audit tail`, `reach agents`, `reach top`),
        until Enter.
        """
        import asyncio

        from reach.demo import run_demo

        if keep is None:
            keep = sys.stdin.isatty() and sys.stdout.isatty()
        try:
            failed = asyncio.run(run_demo(duration=duration, rate=rate, keep=keep))
        except KeyboardInterrupt:
            sys.exit(130)
        sys.exit(1 if failed else 0)
