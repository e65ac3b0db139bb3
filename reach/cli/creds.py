"""``reach creds add|list|revoke`` and ``reach keys rotate``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from reach.cli.common import CommandGroup, Target, connection_options, console, fail, run
from reach.cli.validate import load_yaml
from reach.errors import ConfigurationError
from reach.security.claims import KNOWN_ROLES, ROLE_ADMIN

if TYPE_CHECKING:
    from reach.transport import Connection


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
    "--manifest",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="the agent's manifest (agent.yaml): its capabilities' security_level are checked"
    " against --level; it gives --agent-id, and every capability it declares, when"
    " those are not given",
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
    manifest: Path | None,
    out: Path | None,
) -> None:
    """Create a client with a random secret (shown once).

    An agent credential (--agent-id) serves exactly the capabilities given with --cap:
    the registrar refuses to announce, and NATS to deliver, any other.

    It serves none above its --level: the registrar refuses an announce of a capability
    whose security_level is above the credential's clearance. A capability's level is
    declared in the manifest of the agent that serves it, so this command refuses such a
    credential up front only where it knows the level: from --manifest, and from the
    registry for a capability an instance serves now. Any other is checked when the
    agent announces."""
    from reach.security.credentials import CredentialsFile, CredentialStore
    from reach.security.membership import connect_as

    agent_id, capabilities = _served(level, agent_id, roles, capabilities, manifest)

    async def go() -> None:
        conn, _ = await connect_as(
            target.servers, name="reach-creds", credentials=target.credentials
        )
        try:
            store = await CredentialStore.open(conn, create=True)
            await _check_served_levels(conn, capabilities, level)
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


def _served(
    level: int,
    agent_id: str | None,
    roles: tuple[str, ...],
    capabilities: tuple[str, ...],
    manifest: Path | None,
) -> tuple[str | None, tuple[str, ...]]:
    """The agent id and capabilities of a credential (from ``manifest`` where not given);
    a usage error for an agent credential without them, or one that would serve a
    capability the manifest declares above ``level``."""
    levels: dict[str, int] = {}
    if manifest is not None:
        agent_id, capabilities, levels = _read_manifest(manifest, agent_id, capabilities)
    if agent_id is not None and not capabilities and ROLE_ADMIN not in roles:
        raise click.UsageError(
            "an agent credential (--agent-id) needs --cap NAME for each capability it serves"
        )
    if capabilities and agent_id is None:
        raise click.UsageError("--cap names what an agent serves: give --agent-id too")
    for name in capabilities:
        if levels.get(name, 0) > level:
            where = f"at security_level {levels[name]} in {manifest}"
            fail(_above_level(name, where, level), code=2)
    return agent_id, capabilities


def _above_level(capability: str, where: str, level: int) -> str:
    """The one-line usage error of a capability above the credential's level."""
    return (
        f"--cap {capability}: {capability} is {where}, above --level {level}:"
        " an agent serves no capability above its credential's level"
    )


def _read_manifest(
    path: Path, agent_id: str | None, capabilities: tuple[str, ...]
) -> tuple[str | None, tuple[str, ...], dict[str, int]]:
    """(agent id, capabilities, each declared capability's security_level) of a
    credential made for the agent of manifest ``path``: the given agent id and
    capabilities, else the manifest's; a usage error where they disagree with it."""
    from reach.wire.models import parse_manifest

    data = load_yaml(path)
    try:
        parsed = parse_manifest(data, source=str(path))
    except ConfigurationError as exc:
        count = len(exc.errors)
        fail(f"{path}: invalid manifest, {count} problem(s) (reach validate {path})", code=2)
    declared = data.get("agent_id") if isinstance(data, dict) else None
    if agent_id is None:
        if not declared:
            fail(f"{path} names no agent_id (each start draws one): give --agent-id", code=2)
        agent_id = parsed.agent_id
    elif declared and declared != agent_id:
        fail(f"--agent-id {agent_id}, but {path} says agent_id {declared}", code=2)
    levels = {cap.name: cap.security_level for cap in parsed.capabilities}
    unknown = [name for name in capabilities if name not in levels]
    if unknown:
        fail(f"--cap {unknown[0]}: {path} declares no capability {unknown[0]}", code=2)
    return agent_id, capabilities or tuple(levels), levels


async def _check_served_levels(conn: Connection, capabilities: tuple[str, ...], level: int) -> None:
    """ConfigurationError (a usage error) if an instance in the registry serves one of
    ``capabilities`` above ``level``: an instance of this credential would share its
    calls, and be handed those of callers cleared for more than ``level``."""
    if not capabilities:
        return
    from reach.registry.store import RegistryStore

    try:
        registry = await RegistryStore.open(conn, create=False)
    except ConfigurationError:  # no registry yet: nothing served
        return
    for name in capabilities:
        async for change in registry.watch_routes(name):
            if change is None:  # every route key of the capability read
                break
            cap = change.instance.manifest.capability(name) if change.instance else None
            if cap is not None and cap.security_level > level:
                where = f"served at security_level {cap.security_level} by {change.agent_id}"
                raise ConfigurationError(_above_level(name, where, level))


@creds.command("list", short_help="List every client with its level and roles.")
@click.option("--json", "as_json", is_flag=True)
@connection_options
def list_(target: Target, as_json: bool) -> None:
    """Every client: level, bound agent, roles, created, revoked."""
    from rich.table import Table

    from reach.security.credentials import CredentialStore
    from reach.security.membership import connect_as

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
    from reach.security.credentials import CredentialStore
    from reach.security.membership import connect_as
    from reach.security.revocation import publish_revocation
    from reach.security.tokens import KeyStore

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
    from reach.security.membership import FabricSecurity, connect_as
    from reach.wire import envelope, subjects

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
