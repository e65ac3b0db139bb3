"""``reach agents``: the registry as a table (or JSON lines)."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import click

from reach.cli.common import Target, connection, connection_options, console, run
from reach.errors import ConfigurationError, ReachError

if TYPE_CHECKING:
    from rich.table import Table

    from reach.transport import Connection
    from reach.wire.models import Instance

_STATUS_STYLE = {"healthy": "green", "degraded": "yellow", "unhealthy": "red"}


def age_text(seconds: float) -> str:
    """An age as a person reads it: seconds, then minutes, hours, days."""
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"


#: observed p99 comes from the audit stream's last minute (read oldest first, so a long
#: window on a busy fabric would stop at the cap on old calls), at most this many calls
P99_WINDOW_SEC = 60.0
P99_MAX_EVENTS = 200_000


async def observed_p99(conn: Connection, now: float) -> dict[str, float]:
    """Per agent id: p99 latency of successful calls seen in the audit stream."""
    from reach.audit.reader import read_events
    from reach.audit.stats import CallStats

    stats = CallStats(window_sec=P99_WINDOW_SEC)
    seen = 0
    try:
        async for event in read_events(conn, since=now - P99_WINDOW_SEC):
            stats.add(event)
            seen += 1
            if seen >= P99_MAX_EVENTS:
                break
    except ConfigurationError:
        return {}  # no audit stream on this fabric
    except ReachError as exc:  # not readable with these credentials, say: the list still is
        click.echo(f"note: no observed p99 ({exc})", err=True)
        return {}
    out: dict[str, float] = {}
    for agent_id, tally in stats.by_instance().items():
        p99 = tally.p(0.99)
        if p99 is not None:
            out[agent_id] = p99
    return out


def render_table(
    instances: list[Instance], now: float, p99: dict[str, float] | None = None
) -> Table:
    from rich.table import Table

    p99 = p99 or {}
    table = Table(show_edge=False, header_style="bold")
    columns = ("agent", "version", "capabilities", "health", "load", "p99", "probe", "age")
    for column in columns:
        right = column in ("load", "p99", "probe", "age")
        table.add_column(column, justify="right" if right else "left")
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
            f"{p99[inst.agent_id]:.1f}ms" if inst.agent_id in p99 else "-",
            probe,
            age_text(inst.age(now)),
        )
    return table


def matching(
    instances: list[Instance], capability: str | None, tags: tuple[str, ...]
) -> list[Instance]:
    """The instances offering ``capability`` (any, if None) through a capability that
    carries every one of ``tags``, by agent id: what a caller's route cache finds."""
    wanted = set(tags)

    def offers(inst: Instance) -> bool:
        return any(
            (capability is None or cap.name == capability) and wanted <= set(cap.tags)
            for cap in inst.manifest.capabilities
        )

    return sorted((i for i in instances if offers(i)), key=lambda i: i.agent_id)


async def _agents(
    target: Target, tag: tuple[str, ...], capability: str | None, as_json: bool
) -> None:
    from reach.audit.stats import LATENCY
    from reach.registry.store import RegistryStore

    # one operator's connection, as `reach top` reads: the registry's records at once,
    # then the audit stream (a client's connection is placed with the callers, where
    # the stream is not served)
    async with connection(target, "reach-agents") as conn:
        store = await RegistryStore.existing(conn, target.servers)
        instances = matching((await store.snapshot())[0], capability, tag)
        now = time.time()
        p99 = await observed_p99(conn, now) if instances else {}
    if as_json:
        for inst in instances:
            record = inst.model_dump(mode="json")
            record["observed_p99_ms"] = p99.get(inst.agent_id)
            click.echo(json.dumps(record, sort_keys=True))
        return
    if not instances:
        click.echo("no agents registered" + (" matching the filter" if tag or capability else ""))
        return
    console().print(render_table(instances, now, p99))
    # what p99 measures (as every operator command does), beside the rows, not among them
    click.echo(f"p99 of the last minute's calls; {LATENCY}", err=True)


def register(main: click.Group) -> None:
    @main.command("agents", short_help="List agent instances with health and load.")
    @click.option("--tag", "tag", multiple=True, help="only capabilities carrying this tag")
    @click.option("--capability", default=None, help="only instances offering this capability")
    @click.option("--json", "as_json", is_flag=True, help="one JSON object per line")
    @connection_options
    def agents(target: Target, tag: tuple[str, ...], capability: str | None, as_json: bool) -> None:
        """List registered agent instances with health, load, version and age.

        The p99 column is of the last minute's calls to each instance in the audit
        stream: the round trip of the attempt it answered, as its caller timed it."""
        run(_agents(target, tag, capability, as_json))
