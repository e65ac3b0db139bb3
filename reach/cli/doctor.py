"""``reach doctor CAPABILITY|AGENT_ID``: the troubleshooting order, walked for you."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click

from reach.cli.common import Target, colour_wanted, connection, connection_options, run

if TYPE_CHECKING:
    from reach.fabric.doctor import Diagnosis

_MARK = {"ok": ("ok  ", "green"), "warn": ("warn", "yellow"), "fail": ("FAIL", "red")}


def render(diagnosis: Diagnosis, *, colour: bool) -> str:
    from reach.audit.stats import LATENCY

    lines = [f"reach doctor {diagnosis.target}", f"(p99 {LATENCY})", ""]
    for step in diagnosis.steps:
        mark, fg = _MARK.get(step.verdict, ("skip", "white"))
        label = click.style(mark, fg=fg, bold=True) if colour else mark
        lines.append(f"[{label}] {step.number}. {step.name}")
        lines.extend(f"         {finding}" for finding in step.findings)
    lines.append("")
    verdict = f"most likely at fault: {diagnosis.layer} — {diagnosis.conclusion}"
    if diagnosis.layer == "none":
        verdict = f"no fault found — {diagnosis.conclusion}"
    lines.append(click.style(verdict, bold=True) if colour else verdict)
    return "\n".join(lines)


async def _doctor(target: Target, name: str, window: float, as_json: bool) -> None:
    from reach.audit.stats import LATENCY
    from reach.fabric.doctor import diagnose

    async with connection(target, "reach-doctor") as conn:
        diagnosis = await diagnose(conn, name, window_sec=window, servers=target.servers)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "target": diagnosis.target,
                    "layer": diagnosis.layer,
                    "conclusion": diagnosis.conclusion,
                    "latency": LATENCY,
                    "steps": [
                        {
                            "number": s.number,
                            "name": s.name,
                            "verdict": s.verdict,
                            "findings": s.findings,
                        }
                        for s in diagnosis.steps
                    ],
                },
                indent=2,
            )
        )
        return
    click.echo(render(diagnosis, colour=colour_wanted()))


def register(main: click.Group) -> None:
    @main.command("doctor", short_help="Find the layer at fault for a capability or agent.")
    @click.argument("name", metavar="CAPABILITY|AGENT_ID")
    @click.option(
        "--window", type=float, default=600.0, help="seconds of audit history to read (600)"
    )
    @click.option("--json", "as_json", is_flag=True, help="the diagnosis as JSON")
    @connection_options
    def doctor(target: Target, name: str, window: float, as_json: bool) -> None:
        """Walk the troubleshooting order for a capability or an agent: registry, route
        log, connectivity, the agent, its dependencies, the fabric; then name the layer
        most likely at fault."""
        run(_doctor(target, name, window, as_json))
