"""``reach call CAPABILITY JSON``: one call from the command line, with its route."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from reach.cli.common import Target, connection_options, fail, run
from reach.errors import ReachError


async def _call(target: Target, capability: str, payload: Any, timeout: float | None) -> None:
    from reach.caller.client import ReachClient

    async with ReachClient(
        servers=target.servers, credentials=target.credentials, name="reach-call"
    ) as client:
        try:
            result = await client.call(capability, payload, timeout=timeout)
        except ReachError as exc:
            # the typed error and the layer that failed, so the next step is obvious
            fail(f"{type(exc).__name__} (layer: {exc.layer}): {exc}")
    click.echo(json.dumps(result.value, indent=2, sort_keys=True, default=str))
    how = f"{result.agent_id or 'queue group'} in {result.latency_ms:.1f} ms"
    if result.attempts > 1:
        how += f" after {result.attempts} attempts"
    if result.fallback is not None:
        how = f"fallback ({result.fallback.source}): {result.fallback.reason}"
    click.echo(f"served by {how} (call {result.call_id})", err=True)


def register(main: click.Group) -> None:
    @main.command("call", short_help="Call a capability and print its result.")
    @click.argument("capability")
    @click.argument("payload", metavar="JSON", default="{}")
    @click.option("--timeout", type=float, default=None, help="seconds (default: 1.5 × SLA)")
    @connection_options
    def call(target: Target, capability: str, payload: str, timeout: float | None) -> None:
        """Call CAPABILITY with the JSON payload (use - to read it from stdin) and print
        the result, or the typed error and the layer that failed."""
        text = sys.stdin.read() if payload == "-" else payload
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            raise click.UsageError(f"JSON payload: {exc}") from None
        if timeout is not None and timeout <= 0:
            raise click.UsageError("--timeout must be > 0")
        run(_call(target, capability, body, timeout))
