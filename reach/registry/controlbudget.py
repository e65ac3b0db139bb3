"""How many control messages a registrar takes from one agent id before it drops the rest.

An instance sends one heartbeat per health interval (one more at once after a
reconnect), announces when it starts or is forgotten, and says bye once. A credential
may speak only for its own agent id (NATS permissions and :mod:`reach.registry.message_auth`),
so the agent id on the subject names who is sending. Each agent id is held to
``PER_INTERVAL`` messages per health interval of its record (``DEFAULT_INTERVAL_SEC`` for
an agent id with no record here), never more than ``MAX_RATE`` a second however short the
interval it declares, with a burst of ``BURST`` (``reach.security.ratelimit.RateByKey``).
A message over the budget is dropped before it is decoded: no write, no probe, no audit
event, no log line of its own; the sender is told ``too_many`` if it asked for an answer.
A budget is kept while its agent id comes and goes (a bye and a new announce do not
start a fresh one).

Without it one agent credential flooding its own heartbeat subject turns every message
into a decode, a registry write that every caller following the capability reads, a log
line or an audit event, and holds up the heartbeats, probes and token requests of everyone
else; with it such a flood costs the registrar a dictionary lookup per message, and at
most ``BURST`` plus ``PER_INTERVAL`` writes per interval reach the registry. No I/O.
"""

from __future__ import annotations

from reach.clock import Clock
from reach.security.ratelimit import RateByKey

__all__ = ["BURST", "DEFAULT_INTERVAL_SEC", "MAX_RATE", "PER_INTERVAL", "ControlBudget"]

#: control messages per health interval an agent id may send (it needs one)
PER_INTERVAL = 2.0
#: control messages an agent id may send at once (a restart or a reconnect or two: a bye,
#: an announce, a heartbeat each)
BURST = 8.0
#: control messages per second an agent id may send, whatever interval it declares
MAX_RATE = 20.0
#: the interval assumed for an agent id with no record at this registrar
DEFAULT_INTERVAL_SEC = 1.0


class ControlBudget:
    """Per agent id: may the registrar take one more control message from it now?"""

    def __init__(self, clock: Clock) -> None:
        self._rate = RateByKey(BURST, clock=clock)

    @property
    def dropped(self) -> int:
        """Messages dropped for being over their sender's budget."""
        return self._rate.refused

    def take(self, agent_id: str, interval_sec: float | None) -> bool:
        """True if one more message of ``agent_id`` (health interval ``interval_sec``,
        None if unknown here) is within its budget, which it then uses."""
        rate = PER_INTERVAL / (interval_sec or DEFAULT_INTERVAL_SEC)
        return self._rate.take(agent_id, rate if rate < MAX_RATE else MAX_RATE)
