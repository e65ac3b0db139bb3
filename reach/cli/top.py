"""``reach top``: a live view of instances and capabilities, refreshed every second.

Instances come from the registry (a live route cache); calls/s, success rate, p99 and
breaker states from the audit stream's last minute.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import click

from reach.cli.agents import _STATUS_STYLE
from reach.cli.common import Target, connection, connection_options, console, run
from reach.errors import ReachError

if TYPE_CHECKING:
    from rich.console import Group

    from reach.audit.stats import CallStats, Tally
    from reach.wire.models import Instance


def _rate(tally: Tally | None) -> str:
    if tally is None or tally.success_rate is None:
        return "-"
    return f"{tally.success_rate:.1%}"


def _ms(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "-"


def render(instances: list[Instance], stats: CallStats, now: float, note: str = "") -> Group:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from reach.audit.stats import LATENCY

    stats.trim(now)
    per_inst = stats.by_instance()
    open_breakers = stats.open_breakers(now)
    window = stats.window_sec
    head = Table.grid(padding=(0, 2))
    head.add_row(
        f"[bold]reach top[/]  {time.strftime('%H:%M:%S', time.localtime(now))}",
        f"{len(instances)} instance(s)",
        f"{stats.calls_per_sec(now):.1f} calls/s",
        f"{len(stats.denials)} denial(s) in {window:.0f}s",
    )
    inst_table = Table(show_edge=False, header_style="bold", title_justify="left")
    for column in ("agent", "capabilities", "health", "load", "calls", "ok", "p99 ms", "breaker"):
        right = column in ("load", "calls", "ok", "p99 ms")
        inst_table.add_column(column, justify="right" if right else "left")
    for inst in sorted(instances, key=lambda i: i.agent_id):
        tally = per_inst.get(inst.agent_id)
        style = _STATUS_STYLE.get(inst.status, "")
        breaker = "[red]OPEN[/]" if inst.agent_id in open_breakers else "closed"
        inst_table.add_row(
            inst.agent_id,
            ", ".join(c.name for c in inst.manifest.capabilities),
            f"[{style}]{inst.status}[/]" if style else inst.status,
            f"{inst.in_flight}/{inst.max_concurrency}",
            str(tally.calls if tally else 0),
            _rate(tally),
            _ms(tally.p(0.99) if tally else None),
            breaker,
        )
    cap_table = Table(show_edge=False, header_style="bold")
    for column in ("capability", "calls", "ok", "p50 ms", "p99 ms", "retries", "errors"):
        cap_table.add_column(
            column, justify="left" if column in ("capability", "errors") else "right"
        )
    for capability, tally in sorted(stats.by_capability().items()):
        errors = ", ".join(f"{k} {v}" for k, v in sorted(tally.errors.items())) or "-"
        cap_table.add_row(
            capability,
            str(tally.calls),
            _rate(tally),
            _ms(tally.p(0.5)),
            _ms(tally.p(0.99)),
            str(tally.retries),
            errors,
        )
    # what p50 and p99 measure, as every operator command does
    meaning = Text(f"p50, p99 {LATENCY}", style="dim")
    if note:  # the calls cannot be shown (the audit stream is not readable): say why
        return Group(head, meaning, f"[yellow]{note}[/]", "", inst_table, "", cap_table)
    return Group(head, meaning, "", inst_table, "", cap_table)


async def _top(target: Target, interval: float, window: float, once: bool) -> None:
    import asyncio

    from rich.live import Live

    from reach.audit.reader import read_events
    from reach.audit.stats import CallStats
    from reach.caller.routecache import RouteCache
    from reach.registry.store import RegistryStore
    from reach.tasks import cancel_and_wait

    stats = CallStats(window_sec=window)
    async with connection(target, "reach-top") as conn:
        routes = RouteCache(await RegistryStore.open(conn, create=False))
        await routes.start()
        # the instances come from the registry, the calls from the audit stream: if that
        # cannot be read (credentials without access, say), the instances still show
        note: list[str] = []

        async def read(follow: bool) -> None:
            try:
                async for event in read_events(conn, since=time.time() - window, follow=follow):
                    stats.add(event)
            except ReachError as exc:
                note.append(f"calls not shown: {exc}")

        def view() -> Group:
            return render(routes.all(), stats, time.time(), note[0] if note else "")

        try:
            if once:
                await read(follow=False)
                console().print(view())
                return
            reader = asyncio.create_task(read(follow=True))
            try:
                with Live(view(), auto_refresh=False) as live:
                    while not reader.done() or note:
                        await asyncio.sleep(interval)
                        live.update(view(), refresh=True)
                reader.result()
            finally:
                await cancel_and_wait([reader])
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
        finally:
            await routes.stop()


def register(main: click.Group) -> None:
    @main.command("top", short_help="Show a live view of instances and calls.")
    @click.option("--interval", type=float, default=1.0, help="seconds between refreshes")
    @click.option("--window", type=float, default=60.0, help="seconds of calls to summarise")
    @click.option("--once", is_flag=True, help="print one frame and exit (for scripts)")
    @connection_options
    def top(target: Target, interval: float, window: float, once: bool) -> None:
        """A live view: instances with health, load, calls, success rate, p99 and breaker
        state; capabilities with calls, p50/p99, retries and errors. Ctrl-C to quit."""
        if interval <= 0 or window <= 0:
            raise click.UsageError("--interval and --window must be > 0")
        run(_top(target, interval, window, once))
