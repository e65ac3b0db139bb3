"""``reach call CAPABILITY JSON``: one call from the command line, with its route."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from reach.cli.common import Target, connection_options, fail, run, wait_option
from reach.errors import ReachError


async def _call(
    target: Target, capability: str, payload: Any, timeout: float | None, wait: float | None
) -> None:
    from reach.caller.client import ReachClient

    async with ReachClient(
        servers=target.servers, credentials=target.credentials, name="reach-call"
    ) as client:
        try:
            result = await client.call(capability, payload, timeout=timeout)
            value = result.value
            if result.job is not None and wait is not None:
                value = await result.job.result(timeout=wait or None)
        except ReachError as exc:
            # the typed error and the layer that failed, so the next step is obvious
            fail(f"{type(exc).__name__} (layer: {exc.layer}): {exc}")
    click.echo(json.dumps(value, indent=2, sort_keys=True, default=str))
    if result.job is not None and wait is None:
        job_id = result.job.job_id
        click.echo(
            f"{capability} runs as a job: `reach jobs get {job_id}` reads its result"
            " (`reach call --wait` waits for it)",
            err=True,
        )
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
    @wait_option(
        "for a capability that runs as a job: wait for its result (at most SECONDS;"
        " without a value, as long as it takes) instead of printing its job id"
    )
    @connection_options
    def call(
        target: Target, capability: str, payload: str, timeout: float | None, wait: float | None
    ) -> None:
        """Call CAPABILITY with the JSON payload (use - to read it from stdin) and print
        the result, or the typed error and the layer that failed. A capability that runs
        as a job answers with its job id (`reach jobs get JOB_ID` reads the result
        later), or with its result under `--wait`."""
        text = sys.stdin.read() if payload == "-" else payload
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            raise click.UsageError(f"JSON payload: {exc}") from None
        if timeout is not None and timeout <= 0:
            raise click.UsageError("--timeout must be > 0")
        if wait is not None and wait < 0:
            raise click.UsageError("--wait must be >= 0")
        run(_call(target, capability, body, timeout, wait))
