"""A local user other than the owner reads nothing under a `reach up` store: the store and
every directory in it are 0700, every file 0600 (the server log names the users of failed
logins; the store holds the service passwords, signing keys and every stream)."""

from __future__ import annotations

import stat

import nats
import nats.errors
import pytest

from .conftest import UpFabric


async def test_the_store_and_everything_in_it_are_the_owners_alone(up_fabric: UpFabric) -> None:
    # a failed login, so the log has something to hide
    with pytest.raises(nats.errors.Error):
        await nats.connect(
            up_fabric.url, user="nobody", password="x", allow_reconnect=False, connect_timeout=2
        )
    assert (up_fabric.store / "nats-server.log").exists() or any(up_fabric.store.rglob("*.log"))
    wide = []
    for path in [up_fabric.store, *up_fabric.store.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        if path.is_symlink():
            continue
        if mode & 0o077:
            wide.append(f"{path.relative_to(up_fabric.store)}: {mode:o}")
    assert wide == []
