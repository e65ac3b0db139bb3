"""``reach jobs get JOB_ID``: the state and result of a job an async capability accepted."""

from __future__ import annotations

import json
from typing import Any

import click

from reach.cli.common import Target, connection_options, fail, run, wait_option
from reach.errors import ReachError


def print_value(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True, default=str))


async def _get(target: Target, job_id: str, wait: float | None) -> None:
    from reach.caller.client import ReachClient

    async with ReachClient(
        servers=target.servers, credentials=target.credentials, name="reach-jobs"
    ) as client:
        try:
            job = await client.job(job_id)
            if wait is not None:
                print_value(await job.result(timeout=wait or None))
                click.echo(f"job {job_id} succeeded ({job.capability} at {job.agent_id})", err=True)
                return
            record = await job.status()
        except ReachError as exc:
            fail(f"{type(exc).__name__} (layer: {exc.layer}): {exc}")
    if record.status == "succeeded":
        print_value(record.result)
    elif record.status == "failed":
        error = record.error_value()
        fail(f"job {job_id} failed: {type(error).__name__} (layer: {error.layer}): {error}")
    click.echo(
        f"job {job_id}: {record.status} ({record.capability} at {record.agent_id})"
        + ("" if record.done else f"; `reach jobs get {job_id} --wait` waits for its result"),
        err=True,
    )


def register(main: click.Group) -> None:
    @main.group("jobs", short_help="Read the jobs of async capabilities.")
    def jobs() -> None:
        """Jobs: what an async-mode capability answers a call with, its result kept in
        REACH_JOBS for the caller (a credential with the jobs role)."""

    @jobs.command("get", short_help="Print a job's state, or its result once done.")
    @click.argument("job_id")
    @wait_option("wait for the result (at most SECONDS; without a value, as long as it takes)")
    @connection_options
    def get(target: Target, job_id: str, wait: float | None) -> None:
        """Print the result of job JOB_ID if it succeeded, its typed error if it failed
        (exit status 1), or its state while it runs (`--wait` waits for the result)."""
        if wait is not None and wait < 0:
            raise click.UsageError("--wait must be >= 0")
        run(_get(target, job_id, wait))
