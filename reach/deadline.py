"""A call's deadline: one value on the injected clock, converted once at the wire.

A deadline is kept on its clock's monotonic scale, so that a wall clock set back or
forth while a call runs changes nothing about how long the call waits. Between processes
it travels as absolute Unix milliseconds (the request envelope's ``dl``), and that value
is fixed once: when the deadline is made from a timeout, or read from a request; every
attempt of a call sends the same milliseconds (or sooner ones, for an attempt given less
time). A nested call's deadline is made from the time its parent has left
(``remaining``), which holds whatever clock either side runs on.
"""

from __future__ import annotations

from typing import Final

from reach.clock import Clock

__all__ = ["Deadline"]


def _wire_after(seconds: float, clock: Clock) -> int:
    """The wire value (Unix milliseconds) of the time ``seconds`` from now on ``clock``."""
    return int((clock.time() + seconds) * 1000)


class Deadline:
    """The time by which something must be done: ``at`` on ``clock``'s monotonic scale,
    ``wire_ms`` as it travels (Unix milliseconds). Immutable; make one with
    :meth:`after` or :meth:`from_wire`."""

    __slots__ = ("at", "clock", "wire_ms")

    def __init__(self, at: float, wire_ms: int, clock: Clock) -> None:
        #: the deadline in seconds on ``clock.monotonic()``
        self.at: Final = at
        #: the deadline as it travels: absolute, Unix milliseconds
        self.wire_ms: Final = wire_ms
        #: the clock it is kept on (and that sleeps while waiting for it)
        self.clock: Final = clock

    @staticmethod
    def after(seconds: float, clock: Clock) -> Deadline:
        """The deadline ``seconds`` from now on ``clock``."""
        return Deadline(clock.monotonic() + seconds, _wire_after(seconds, clock), clock)

    @staticmethod
    def from_wire(wire_ms: int, clock: Clock) -> Deadline:
        """The deadline a request carries (Unix milliseconds), on ``clock``: its time left
        as this side's wall clock sees it, counted from now on the monotonic scale."""
        return Deadline(clock.monotonic() + (wire_ms / 1000.0 - clock.time()), wire_ms, clock)

    def remaining(self) -> float:
        """Seconds left until the deadline (negative once it passed)."""
        return self.at - self.clock.monotonic()

    def expired(self) -> bool:
        """Has the deadline passed?"""
        return self.clock.monotonic() >= self.at

    def to_wire(self) -> int:
        """The deadline as it travels: absolute, Unix milliseconds."""
        return self.wire_ms

    def to_wire_within(self, seconds: float) -> int:
        """The wire value of this deadline or of ``seconds`` from now, whichever is
        sooner (an attempt that may take part of a call's time)."""
        return min(self.wire_ms, _wire_after(seconds, self.clock))

    def __repr__(self) -> str:
        return f"Deadline(in {self.remaining():.3f} s, wire {self.wire_ms})"
