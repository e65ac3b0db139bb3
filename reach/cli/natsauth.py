"""``reach nats-auth``: the login gate for nats-servers that ``reach up`` does not start.

``reach up`` configures the nats-servers it starts itself. For a NATS deployment of your own
(docker/compose.yaml, say) this writes the accounts and the auth callout into a file that
each server's config includes; ``reach up --servers URL --auth-callout --store STORE`` then
answers the servers' logins with the same store's secrets.
"""

from __future__ import annotations

from pathlib import Path

import click

from reach.cli.common import store_option

__all__ = ["register"]


def register(main: click.Group) -> None:
    main.add_command(nats_auth)


@click.command("nats-auth", short_help="Write NATS accounts for your own servers.")
@store_option("the store `reach up --auth-callout` will run with (its secrets are created once)")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="the file to write (default: STORE/nats-auth.conf); mode 0600",
)
def nats_auth(store: Path, out: Path | None) -> None:
    """Write the NATS accounts and login gate (auth callout) for your own nats-servers.

    Include the file in every server's config (`include "nats-auth.conf"`: the path is
    relative to the including file), then run `reach up --servers URL,... --auth-callout
    --store STORE`. Every client must then log in with a credential (`reach creds add`);
    the registrar logs in as a service user. The file holds the service passwords.
    """
    from reach.security import natsconf

    setup = natsconf.prepare(store)
    path = natsconf.write_auth(setup, out if out is not None else store / "nats-auth.conf")
    click.echo(f"wrote {path} (mode 0600): include it in each nats-server's config")
