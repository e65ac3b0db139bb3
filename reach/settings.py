"""Where to find NATS and credentials: arguments, then environment, then defaults."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["DEFAULT_STORE", "DEFAULT_URL", "resolve_credentials", "resolve_servers"]

DEFAULT_URL = "nats://127.0.0.1:4222"
DEFAULT_STORE = ".reach"


def resolve_servers(servers: str | Sequence[str] | None = None) -> list[str]:
    """``servers=`` argument, else ``REACH_URL`` (comma separated), else the local default."""
    if servers is None:
        servers = os.environ.get("REACH_URL") or DEFAULT_URL
    if isinstance(servers, str):
        servers = servers.split(",")
    return [s.strip() for s in servers if s.strip()]


def resolve_credentials(credentials: str | os.PathLike[str] | None = None) -> Path | None:
    """``credentials=`` argument, else ``REACH_CREDS``, else ``.reach/dev.creds`` if it exists."""
    if credentials is not None:
        return Path(credentials)
    env = os.environ.get("REACH_CREDS")
    if env:
        return Path(env)
    dev = Path(DEFAULT_STORE) / "dev.creds"
    return dev if dev.exists() else None
