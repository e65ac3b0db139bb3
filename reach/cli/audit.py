"""``reach audit tail``: the audit stream, history and live, one line per call (its
events merged by call id, ``reach.audit.merge``)."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, get_args

import click

from reach.audit.events import ErrorClass, Outcome
from reach.cli.common import Target, colour_wanted, connection, connection_options, run
from reach.errors import ReachError

if TYPE_CHECKING:
    from reach.audit.reader import AuditFilter, AuditRecord
    from reach.transport import Connection

#: what --kind takes: an outcome, "retry", or an error class
KINDS = tuple(dict.fromkeys([*get_args(Outcome), "retry", *get_args(ErrorClass)]))


async def _agents_of(conn: Connection) -> dict[str, str | None] | None:
    """Client id → the agent id its credential is bound to (what verifies a callee's
    denial), when these credentials may read REACH_CREDENTIALS (an admin's); else None."""
    from reach.security.credentials import CredentialStore

    try:
        store = await CredentialStore.open(conn, create=False)
        return {record.client_id: record.agent_id for record in await store.list()}
    except ReachError:
        return None


async def _tail(
    target: Target, flt: AuditFilter, since: str | None, follow: bool, as_json: bool
) -> None:
    from reach.audit.merge import merge_calls
    from reach.audit.reader import AuditFilter, format_event, parse_since, read_records
    from reach.audit.stats import LATENCY

    start = parse_since(since, time.time()) if since else None
    colour = colour_wanted() and not as_json
    async with connection(target, "reach-audit-tail") as conn:
        agents = await _agents_of(conn)
        if not as_json:  # what the figures are, beside (not among) the events
            click.echo(LATENCY, err=True)
        shown = 0
        records = read_records(conn, flt, since=start, follow=follow, agents=agents)
        async for call in merge_calls(records):
            shown += 1
            record = call.record
            if as_json:
                body = _json(record)
                # the call's other events (its callee's beside its caller's, say)
                body["also"] = [_json(other) for other in call.others]
                click.echo(json.dumps(body, sort_keys=True))
            else:
                line = format_event(
                    record.event, colour=colour, writer=record.writer, found=record.verdict
                )
                click.echo(line + _also(call.others))
        if not follow and not shown and not as_json:
            click.echo("no audit events" + (" matching the filter" if flt != AuditFilter() else ""))


def _json(record: AuditRecord) -> dict[str, object]:
    body: dict[str, object] = record.event.model_dump(mode="json")
    # who wrote it (the subject's writer token) beside what it claims
    body |= {"writer": record.writer, "verified": record.verified}
    return body


def _also(others: tuple[AuditRecord, ...]) -> str:
    """The call's other events, in a few words: who else recorded it and how it ended
    there (a callee's handling time, a denial)."""
    if not others:
        return ""
    said = []
    for other in others:
        event = other.event
        how = event.outcome if event.outcome != "error" else f"{event.error} {event.code}".strip()
        said.append(f"{event.side} {event.callee or other.writer}: {how} {event.latency_ms:.1f}ms")
    return "  [also " + "; ".join(said) + "]"


def register(main: click.Group) -> None:
    @main.group("audit", short_help="Read the audit stream of cross-agent calls.")
    def audit() -> None:
        """The audit stream REACH_AUDIT: every cross-agent call, recorded by its callee,
        its caller, or both."""

    @audit.command("tail", short_help="Print audit events, with -f new ones live.")
    @click.option("-f", "--follow", is_flag=True, help="keep printing new events as they come")
    @click.option("--caller", default="", help="only calls by this client id or agent id")
    @click.option(
        "--actor",
        default="",
        help="only calls this gateway (client id) made for the clients logged in through it",
    )
    @click.option(
        "--callee",
        default="",
        help="only calls served, tried, or passed over (open breaker) by this agent id",
    )
    @click.option("--capability", default="", help="only calls to this capability")
    @click.option(
        "--kind",
        default="",
        type=click.Choice(["", *KINDS]),
        metavar="KIND",
        help="ok, error, fallback, denied, retry, or an error class:"
        " connect, timeout, business, breaker (also: an open breaker passed over),"
        " contract, unavailable, discovery, internal",
    )
    @click.option("--since", default=None, help="start this long ago (10m, 2h, 30s) or at a time")
    @click.option("--json", "as_json", is_flag=True, help="one JSON object per line")
    @connection_options
    def tail(
        target: Target,
        follow: bool,
        caller: str,
        actor: str,
        callee: str,
        capability: str,
        kind: str,
        since: str | None,
        as_json: bool,
    ) -> None:
        """Print audit events (all history, or --since), then with -f new ones live.

        A call a gateway (reach mcp, reach a2a) made for a client logged in through it
        shows as `<caller> via <gateway>`; --actor picks a gateway's calls.

        Who wrote an event is the writer named by its subject (the server lets a client
        write only under its own id): an event whose writer is not who it says recorded
        it is marked FORGED? writer=<id> (--json: "writer", "verified": false). A callee's
        denial is verified only with credentials that may read REACH_CREDENTIALS (an
        admin's); on an open fabric nothing is (writer "anonymous")."""
        from reach.audit.reader import AuditFilter

        flt = AuditFilter(
            caller=caller, callee=callee, capability=capability, kind=kind, actor=actor
        )
        run(_tail(target, flt, since, follow, as_json))
