"""``reach alerts``: what the alert rules raised (stream REACH_ALERTS)."""

from __future__ import annotations

import datetime
import json
import time
from typing import TYPE_CHECKING

import click

from reach.audit.rulenames import RULES
from reach.cli.common import Target, colour_wanted, connection, connection_options, run
from reach.wire import subjects

if TYPE_CHECKING:
    from reach.audit.alerts import Alert


def format_alert(alert: Alert, *, colour: bool) -> str:
    when = datetime.datetime.fromtimestamp(alert.ts).strftime("%Y-%m-%d %H:%M:%S")
    label = f"{alert.severity.upper():<8} {alert.rule}"
    if colour:
        label = click.style(label, fg="red" if alert.severity == "critical" else "yellow")
    return f"{when}  {label}  {alert.summary}"


async def _alerts(
    target: Target, rule: str | None, since: str | None, follow: bool, as_json: bool
) -> None:
    from reach.audit.alerts import decode_alert
    from reach.audit.reader import parse_since
    from reach.transport.streamreads import read_stream

    start = parse_since(since, time.time()) if since else None
    colour = colour_wanted() and not as_json
    async with connection(target, "reach-alerts") as conn:
        shown = 0
        reading = read_stream(
            conn, subjects.ALERTS_STREAM, subjects.alert(rule or "*"), since=start, follow=follow
        )
        async for msg in reading:
            alert = decode_alert(msg.data)
            if alert is None:
                continue
            shown += 1
            if as_json:
                click.echo(json.dumps(alert.model_dump(mode="json"), sort_keys=True))
            else:
                click.echo(format_alert(alert, colour=colour))
        if not follow and not shown and not as_json:
            click.echo("no alerts")


def register(main: click.Group) -> None:
    @main.command("alerts", short_help="Print the alerts the fabric raised.")
    @click.option("-f", "--follow", is_flag=True, help="keep printing new alerts as they fire")
    @click.option("--rule", type=click.Choice(RULES), default=None, help="only this rule")
    @click.option("--since", default=None, help="start this long ago (10m, 2h, 1d) or at a time")
    @click.option("--json", "as_json", is_flag=True, help="one JSON object per line")
    @connection_options
    def alerts(
        target: Target, follow: bool, rule: str | None, since: str | None, as_json: bool
    ) -> None:
        """Print alerts: retry storms, instances turning unhealthy, breaker rejections,
        new agents failing probes, audit events dropped, a JetStream store that takes no
        writes (a full disk)."""
        run(_alerts(target, rule, since, follow, as_json))
