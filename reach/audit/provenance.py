"""Who wrote an audit event: the writer token of its subject against what it claims.

The server lets each client publish audit batches and notices only under its own client
id (``reach.v1.audit.<capability>.<client_id>``, see ``callout.permissions_for``), so the
subject names the writer and the body only makes claims. An event is genuine when its
writer is the one it says recorded it: a caller's event its ``caller``, or its ``actor``
when it names one (a gateway records the calls it makes for the clients that logged in
through it), a registrar's event the registrar's service user, a callee's denial the
client bound to its ``callee`` agent (which only a reader of REACH_CREDENTIALS can tell).

A gateway's event is its own word that it called for ``caller``: the issuer let it do so
only for a client that logged in through it (the call token it got names both), and the
callee's events of such calls name the actor from that token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from reach.wire.subjects import ANONYMOUS

__all__ = ["REGISTRAR_WRITER", "Verdict", "verdict"]

#: the NATS user a ``reach up`` registrar logs in as (``natsconf.REGISTRAR_USER``): in the
#: server's own users, so no client's login can take it
REGISTRAR_WRITER = "reach-registrar"

#: ``verified``: the writer is who the event says wrote it; ``forged``: someone else
#: wrote it; ``unverified``: nothing to check it against (an open fabric's anonymous
#: writer, a batch stored before subjects named their writer, a callee's denial read
#: without the credentials that bind clients to agents)
Verdict = Literal["verified", "unverified", "forged"]


def verdict(
    side: str,
    caller: str,
    callee: str,
    writer: str,
    agents: Mapping[str, str | None] | None = None,
    actor: str | None = None,
) -> Verdict:
    """Whether ``writer`` (``subjects.writer_of`` the event's subject) wrote an event of
    ``side`` about ``caller`` and ``callee``, made by ``actor`` for ``caller`` if it names
    one. ``agents``: client id → the agent id its credential is bound to, when the reader
    could read them."""
    if not writer or writer == ANONYMOUS:
        return "unverified"
    if side == "caller":
        # the client that made the call records it: the gateway, when one called for caller
        return "verified" if writer == (actor or caller) else "forged"
    if side == "registrar":
        return "verified" if writer == REGISTRAR_WRITER else "forged"
    if side == "callee":
        if agents is None:
            return "unverified"
        return "verified" if callee and agents.get(writer) == callee else "forged"
    return "forged"
