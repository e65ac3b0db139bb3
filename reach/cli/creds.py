"""``reach creds add|list|revoke`` and ``reach keys rotate``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
from rich.table import Table

from reach import envelope, subjects
from reach.cli.common import CommandGroup, Target, connection_options, console, fail, run
from reach.errors import ConfigurationError
from reach.security.credentials import KNOWN_ROLES, ROLE_ADMIN, CredentialsFile, CredentialStore
from reach.security.fabric import FabricSecurity, connect_as
from reach.security.revocation import publish_revocation
from reach.security.tokens import KeyStore


def register(main: click.Group) -> None:
    main.add_command(creds)
    main.add_command(keys)


@click.group("creds", cls=CommandGroup, short_help="Add, list and revoke client credentials.")
def creds() -> None:
    """Client credentials: a client id and a random secret, stored only as a verifier of it."""


@creds.command("add")
@click.argument("client_id")
@click.option("--level", type=click.IntRange(1, 4), required=True, help="clearance level 1..4")
@click.option("--agent-id", default=None, help="the agent this client may announce as")
@click.option("--role", "roles", multiple=True, type=click.Choice(sorted(KNOWN_ROLES)))
@click.option(
    "--cap",
    "capabilities",
    multiple=True,
    help="a capability the bound agent serves (its queue subject); repeat for several",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="write a credentials file (mode 0600) usable as REACH_CREDS instead of printing",
)
@connection_options
def add(
    target: Target,
    client_id: str,
    level: int,
    agent_id: str | None,
    roles: tuple[str, ...],
    capabilities: tuple[str, ...],
    out: Path | None,
) -> None:
    """Create a client with a random secret (shown once).

    An agent credential (--agent-id) serves exactly the capabilities given with --cap:
    the registrar refuses to announce, and NATS to deliver, any other."""
    if agent_id is not None and not capabilities and ROLE_ADMIN not in roles:
        raise click.UsageError(
            "an agent credential (--agent-id) needs --cap NAME for each capability it serves"
        )
    if capabilities and agent_id is None:
        raise click.UsageError("--cap names what an agent serves: give --agent-id too")

    async def go() -> None:
        conn, _ = await connect_as(
            target.servers, name="reach-creds", credentials=target.credentials
        )
        try:
            store = await CredentialStore.open(conn, create=True)
            record, secret = await store.add(
                client_id, level, agent_id=agent_id, roles=roles, capabilities=capabilities
            )
        finally:
            await conn.close()
        if out is not None:
            CredentialsFile(target.servers[0], record.client_id, secret).write(out)
            click.echo(f"created {record.client_id} (level {level}); credentials in {out}")
        else:
            click.echo(f"created {record.client_id} (level {level})")
            click.echo(f"secret (shown once): {secret}")

    run(go())


@creds.command("list", short_help="List every client with its level and roles.")
@click.option("--json", "as_json", is_flag=True)
@connection_options
def list_(target: Target, as_json: bool) -> None:
    """Every client: level, bound agent, roles, created, revoked."""

    async def go() -> None:
        conn, _ = await connect_as(
            target.servers, name="reach-creds", credentials=target.credentials
        )
        try:
            store = await CredentialStore.open(conn, create=False)
            records = await store.list()
        finally:
            await conn.close()
        if as_json:
            for record in records:
                data = record.model_dump(mode="json", exclude={"secret_hash"})
                click.echo(json.dumps(data, sort_keys=True))
            return
        table = Table(show_edge=False, header_style="bold")
        for column in ("client", "level", "agent", "roles", "created", "revoked"):
            table.add_column(column)
        for record in records:
            table.add_row(
                record.client_id,
                str(record.level),
                record.agent_id or "-",
                ",".join(record.roles) or "-",
                time.strftime("%Y-%m-%d %H:%M", time.localtime(record.created_at)),
                "yes" if record.revoked else "",
            )
        console().print(table)

    run(go())


@creds.command("revoke", short_help="Revoke a client: no more logins or tokens.")
@click.argument("client_id")
@connection_options
def revoke(target: Target, client_id: str) -> None:
    """Refuse the client: no new logins or tokens, its tokens void, its connections closed.

    The login gate of `reach up` closes the client's open NATS connections within seconds;
    every verifier refuses the tokens it was issued up to now (revoked.<client_id> in
    REACH_KEYS). Revoking again publishes the revocation again (for clients revoked before
    revocations voided tokens)."""

    async def go() -> None:
        conn, _ = await connect_as(
            target.servers, name="reach-creds", credentials=target.credentials
        )
        try:
            store = await CredentialStore.open(conn, create=False)
            record = await store.revoke(client_id)
            assert record.revoked_at is not None
            try:
                keys = await KeyStore.open(conn, create=False)
            except ConfigurationError:
                keys = None  # a fabric without REACH_KEYS issues no tokens to void
            if keys is not None:
                await publish_revocation(keys.bucket, record.client_id, record.revoked_at)
        finally:
            await conn.close()
        click.echo(f"revoked {client_id}")

    run(go())


@click.group("keys", cls=CommandGroup)
def keys() -> None:
    """Token-signing keys."""


@keys.command("rotate", short_help="Sign new tokens with a new key.")
@connection_options
def rotate(target: Target) -> None:
    """Sign new tokens with a new key; tokens of the old one stay valid until they expire."""

    async def go() -> None:
        conn, creds = await connect_as(
            target.servers, name="reach-keys", credentials=target.credentials
        )
        try:
            security = await FabricSecurity.join(conn, creds, verify=False)
            try:
                request = envelope.pack_request(
                    envelope.RequestMeta(call_id="rotate", token=security.token()), b""
                )
                reply = envelope.unpack_reply(
                    await conn.request(subjects.KEY_ROTATE, request, timeout=10)
                )
            finally:
                await security.close()
        finally:
            await conn.close()
        if not reply.ok:
            fail(f"rotation refused: {reply.description}")
        click.echo(f"rotated: new signing key {reply.body.decode()}")

    run(go())
