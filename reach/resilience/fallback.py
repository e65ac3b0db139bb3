"""What a call falls back to when no instance can answer in time."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

from reach.errors import ConfigurationError

__all__ = ["MISSING", "NO_FALLBACK", "Fallback", "FallbackInfo", "ResultCache"]


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


@dataclass(frozen=True)
class Fallback:
    """Tried in order: a cached earlier result, a backup capability/tags, a default body.

    ``cache_max_age_sec``: reuse the last successful result for the same capability and
    payload if it is at most this old. ``backup_capability`` / ``backup_tags``: call a
    similar capability instead (same payload). ``default``: return this body.
    """

    cache_max_age_sec: float | None = None
    backup_capability: str | None = None
    backup_tags: tuple[str, ...] = ()
    default: Any = field(default=MISSING)

    def __post_init__(self) -> None:
        if self.cache_max_age_sec is not None and self.cache_max_age_sec <= 0:
            raise ConfigurationError("Fallback.cache_max_age_sec must be > 0")
        if (
            self.cache_max_age_sec is None
            and self.backup_capability is None
            and not self.backup_tags
            and self.default is MISSING
        ):
            raise ConfigurationError("a Fallback needs a cache age, a backup or a default")


class _NoFallback(Fallback):
    """``fallback=`` for a call that must not fall back, whatever the client's default."""

    def __post_init__(self) -> None:
        pass


#: ``call(..., fallback=NO_FALLBACK)``: no fallback for this call (a backup's own call)
NO_FALLBACK: Fallback = _NoFallback()


@dataclass(frozen=True)
class FallbackInfo:
    """Why and from where a result came when the capability itself could not answer."""

    source: Literal["cache", "backup", "default"]
    reason: str
    age_sec: float | None = None
    backup: str | None = None


class ResultCache:
    """Last good result per (capability, payload bytes), bounded."""

    def __init__(self, max_entries: int = 10_000) -> None:
        self._items: OrderedDict[tuple[str, bytes], tuple[float, Any]] = OrderedDict()
        self._max = max_entries

    def put(self, capability: str, payload: bytes, value: Any, now: float) -> None:
        key = (capability, payload)
        self._items[key] = (now, value)
        self._items.move_to_end(key)
        if len(self._items) > self._max:
            self._items.popitem(last=False)

    def get(
        self, capability: str, payload: bytes, now: float, max_age: float
    ) -> tuple[float, Any] | None:
        hit = self._items.get((capability, payload))
        if hit is None or now - hit[0] > max_age:
            return None
        return now - hit[0], hit[1]
