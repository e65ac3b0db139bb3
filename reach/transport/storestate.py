"""Why a write to JetStream went unanswered: the fabric's store takes no writes.

A write to a store that takes none is not answered (a single server whose store met
``no space left on device``) or finds no stream listening (a server that disabled
JetStream): the writer sees a timeout, or no responders, and nothing names the disk. The
fabric's registrar part reads the servers' own health (``reach.transport.serverhealth``)
and says what it found in its answer to a registrar ping (``RegistrarRecord.store_problem``).
``StoreState`` is a connection's knowledge of it: told by the registrar part on its own
connections (``known``), asked of the registrars by every other one once a write failed
so, and a write's failure then becomes a ``StoreFull`` that names the problem.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from reach.errors import NoResponders, ReachError, ReachTimeout, StoreFull
from reach.wire import codec, envelope

__all__ = ["ASK_EVERY_SEC", "ASK_TIMEOUT", "StoreState", "problem_in_ping_answer", "store_full"]

#: an answer of the registrars is used for this long before they are asked again
ASK_EVERY_SEC = 1.0
#: how long the registrars are given to answer
ASK_TIMEOUT = 1.0

#: asks the fabric what is wrong with its store: the problem, "" for nothing, None when
#: nobody answered
Ask = Callable[[], Awaitable[str | None]]


def store_full(what: str, problem: str) -> StoreFull:
    """The error of a write (``what``) that the store did not take, for ``problem``."""
    return StoreFull(
        f"{what}: not stored: the fabric's JetStream store takes no writes: {problem};"
        " writes succeed again once space is freed on the disk of the server's store"
        " (reach up restarts a server of its own once there is room)",
        problem=problem,
    )


def problem_in_ping_answer(data: bytes) -> str | None:
    """The store problem a registrar's answer to a ping names ("" for none; a registrar
    of a release before it says nothing); None for what is not such an answer."""
    try:
        reply = envelope.unpack_reply(data)
        record = codec.decode(reply.body) if reply.ok else None
    except ReachError:
        return None
    if not isinstance(record, dict):
        return None
    problem = record.get("store_problem", "")
    return problem if isinstance(problem, str) else ""


class StoreState:
    """What one connection knows of the fabric's JetStream store."""

    __slots__ = ("_ask", "_asked_at", "_said", "known")

    def __init__(self, ask: Ask | None = None) -> None:
        self._ask = ask
        #: the problem as told by whoever reads the servers' health ("" for none); None:
        #: not told, the registrars are asked
        self.known: str | None = None
        self._said: str | None = None
        self._asked_at = float("-inf")

    def set_ask(self, ask: Ask) -> None:
        self._ask = ask

    async def explain(self, err: ReachError, what: str) -> ReachError:
        """``err``, the failure of the write ``what``; a ``StoreFull`` instead of an
        unanswered write or one nobody listened to when the store takes no writes."""
        if not isinstance(err, ReachTimeout | NoResponders):
            return err
        problem = await self.problem()
        return store_full(what, problem) if problem else err

    async def problem(self) -> str:
        """The store's problem as known or as the registrars say it ("" for none)."""
        if self.known is not None:
            return self.known
        if self._ask is None:
            return ""
        now = time.monotonic()
        if now - self._asked_at >= ASK_EVERY_SEC:
            self._asked_at = now
            self._said = await self._ask()
        return self._said or ""
