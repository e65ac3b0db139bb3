"""Where to find NATS and credentials: arguments, then environment, then defaults."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from reach.errors import ConfigurationError

__all__ = [
    "AUDIT_SPOOL_MAX_BYTES",
    "DEFAULT_STORE",
    "DEFAULT_URL",
    "RECONNECT_FOR_ENV",
    "resolve_audit_spool",
    "resolve_audit_spool_max",
    "resolve_credentials",
    "resolve_reconnect_for",
    "resolve_servers",
]

DEFAULT_URL = "nats://127.0.0.1:4222"
DEFAULT_STORE = ".reach"
#: what one audit writer's spool file may hold by default (``REACH_AUDIT_SPOOL_MAX_MB``)
AUDIT_SPOOL_MAX_BYTES = 256 * 1024 * 1024
#: how long a connection that was up keeps reconnecting per outage: seconds, or "forever"
RECONNECT_FOR_ENV = "REACH_RECONNECT_FOR"


def resolve_servers(
    servers: str | Sequence[str] | None = None, credentials: Path | None = None
) -> list[str]:
    """``servers=`` argument, else ``REACH_URL`` (comma separated), else the ``url`` of the
    ``credentials`` file (``reach creds add --out`` writes it), else the local default."""
    if servers is None:
        servers = os.environ.get("REACH_URL") or _url_of(credentials) or DEFAULT_URL
    if isinstance(servers, str):
        servers = servers.split(",")
    return [s.strip() for s in servers if s.strip()]


def _url_of(credentials: Path | None) -> str | None:
    """The ``url`` a credentials file names, if it can be read (reading it for its secret
    later says what is wrong with it otherwise)."""
    if credentials is None:
        return None
    try:
        body = json.loads(credentials.read_bytes())
    except (OSError, ValueError):
        return None
    url = body.get("url") if isinstance(body, dict) else None
    return url if isinstance(url, str) and url.strip() else None


def resolve_credentials(credentials: str | os.PathLike[str] | None = None) -> Path | None:
    """``credentials=`` argument, else ``REACH_CREDS``, else ``.reach/dev.creds`` if it exists."""
    if credentials is not None:
        return Path(credentials)
    env = os.environ.get("REACH_CREDS")
    if env:
        return Path(env)
    dev = Path(DEFAULT_STORE) / "dev.creds"
    return dev if dev.exists() else None


def resolve_audit_spool(spool: str | os.PathLike[str] | None = None) -> Path | None:
    """Where audit writers keep the events REACH_AUDIT has not acknowledged, past their
    memory bound and at shutdown: ``spool=`` argument, else ``REACH_AUDIT_SPOOL``, else
    ``$XDG_STATE_HOME/reach/audit-spool`` (``~/.local/state/reach/audit-spool``). ``off``
    (argument or variable): no spool, events past the memory bound are dropped (counted)."""
    value: str | os.PathLike[str] | None = spool
    if value is None:
        value = os.environ.get("REACH_AUDIT_SPOOL") or None
    if value is not None:
        return None if str(value).strip().lower() == "off" else Path(value).expanduser()
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "reach" / "audit-spool"


def resolve_audit_spool_max(max_bytes: int | None = None) -> int:
    """The size limit of one audit writer's spool file: ``max_bytes=``, else
    ``REACH_AUDIT_SPOOL_MAX_MB`` (MiB), else 256 MiB. A bad value is a ConfigurationError."""
    if max_bytes is not None:
        if max_bytes <= 0:
            raise ConfigurationError(f"the audit spool's size limit must be > 0, not {max_bytes}")
        return max_bytes
    env = os.environ.get("REACH_AUDIT_SPOOL_MAX_MB", "").strip()
    if not env:
        return AUDIT_SPOOL_MAX_BYTES
    try:
        value = int(float(env) * 1024 * 1024)
    except (ValueError, OverflowError):
        value = 0
    if value <= 0:
        raise ConfigurationError(
            f"REACH_AUDIT_SPOOL_MAX_MB must be a positive number of MiB, not {env!r}"
        )
    return value


def resolve_reconnect_for(seconds: float | None = None) -> float | None:
    """How long a lost connection keeps trying to reconnect and log in again: ``seconds``,
    else ``REACH_RECONNECT_FOR`` (seconds, or ``forever``), else forever (None)."""
    if seconds is not None:
        if seconds <= 0:
            raise ConfigurationError(f"reconnect_for must be positive seconds, not {seconds!r}")
        return float(seconds)
    text = os.environ.get(RECONNECT_FOR_ENV, "").strip().lower()
    if text in ("", "forever", "inf"):
        return None
    try:
        value = float(text.removesuffix("s"))
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ConfigurationError(
            f"{RECONNECT_FOR_ENV}={text!r}: give seconds (such as 30) or 'forever'"
        )
    return value
