"""A local user other than the owner reads nothing under a `reach up` store: the store and
every directory in it are 0700, every file 0600 (the server log names the users of failed
logins; the store holds the service passwords, signing keys and every stream)."""

from __future__ import annotations

import stat
from pathlib import Path

from reach.fabric.embedded import EmbeddedServer, free_port
from reach.security import natsconf

from .conftest import UpFabric, raw_login


async def test_the_store_and_everything_in_it_are_the_owners_alone(up_fabric: UpFabric) -> None:
    # a failed login, so the log has something to hide
    port = int(up_fabric.url.rsplit(":", 1)[1])
    assert b"Authorization Violation" in await raw_login(port, "nobody", "x")
    assert (up_fabric.store / "nats-server.log").exists() or any(up_fabric.store.rglob("*.log"))
    wide = []
    for path in [up_fabric.store, *up_fabric.store.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        if path.is_symlink():
            continue
        if mode & 0o077:
            wide.append(f"{path.relative_to(up_fabric.store)}: {mode:o}")
    assert wide == []


async def test_a_flood_of_refused_logins_fills_no_disk(tmp_path: Path) -> None:
    """nats-server logs every refused login: reach up's servers rotate their log at a size
    and keep only a few old files (here with a user and password instead of the callout,
    so that each login is refused at once)."""
    setup = natsconf.prepare(tmp_path / "store")
    text = natsconf.render_config(setup, port=free_port(), store_dir=None)
    assert f"logfile_max_num: {natsconf.LOG_MAX_FILES}" in text
    port = free_port()
    config = tmp_path / "nats.conf"
    config.write_text(
        f"logfile_max_num: {natsconf.LOG_MAX_FILES}\n"
        'authorization { user: "owner", password: "right" }\n'
    )
    server = EmbeddedServer(
        port=port, store_dir=tmp_path / "nats", config_file=config, log_size_limit=2048
    )
    await server.start()
    try:
        for i in range(80):
            assert b"Authorization Violation" in await raw_login(port, f"nobody-{i}", "wrong")
    finally:
        server.stop_now()
    logs = sorted(server.log_file.parent.glob("nats-server.log*"))
    assert 1 < len(logs) <= 1 + natsconf.LOG_MAX_FILES, logs
    assert sum(p.stat().st_size for p in logs) < 2048 * (2 + natsconf.LOG_MAX_FILES)
