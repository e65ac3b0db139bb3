"""``reach agents``: the registry as a table (or JSON lines)."""

from __future__ import annotations

import json
import time

import click
from rich.console import Console
from rich.table import Table

from reach.cli.common import Target, connection_options, run
from reach.client import ReachClient
from reach.models import Instance

_STATUS_STYLE = {"healthy": "green", "degraded": "yellow", "unhealthy": "red"}


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"


def render_table(instances: list[Instance], now: float) -> Table:
    table = Table(show_edge=False, header_style="bold")
    for column in ("agent", "version", "capabilities", "health", "load", "probe", "age"):
        table.add_column(column, justify="right" if column in ("load", "probe", "age") else "left")
    for inst in instances:
        style = _STATUS_STYLE.get(inst.status, "")
        health = f"[{style}]{inst.status}[/]" if style else inst.status
        if inst.status != "healthy" and inst.status_reason:
            health += f" ({inst.status_reason})"
        probe = f"{inst.last_probe_ms:.1f}ms" if inst.last_probe_ms is not None else "-"
        table.add_row(
            inst.agent_id,
            inst.manifest.version,
            ", ".join(c.name for c in inst.manifest.capabilities),
            health,
            f"{inst.in_flight}/{inst.max_concurrency}",
            probe,
            _age(inst.age(now)),
        )
    return table


async def _agents(
    target: Target, tag: tuple[str, ...], capability: str | None, as_json: bool
) -> None:
    async with ReachClient(servers=target.servers, credentials=target.credentials) as client:
        instances = await client.discover(capability=capability, tags=tag, include_unhealthy=True)
    now = time.time()
    if as_json:
        for inst in instances:
            click.echo(json.dumps(inst.model_dump(mode="json"), sort_keys=True))
        return
    if not instances:
        click.echo("no agents registered" + (" matching the filter" if tag or capability else ""))
        return
    Console().print(render_table(instances, now))


def register(main: click.Group) -> None:
    @main.command("agents")
    @click.option("--tag", "tag", multiple=True, help="only capabilities carrying this tag")
    @click.option("--capability", default=None, help="only instances offering this capability")
    @click.option("--json", "as_json", is_flag=True, help="one JSON object per line")
    @connection_options
    def agents(target: Target, tag: tuple[str, ...], capability: str | None, as_json: bool) -> None:
        """List registered agent instances with health, load, version and age."""
        run(_agents(target, tag, capability, as_json))
