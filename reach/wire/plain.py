"""A base for the small value classes built on every call (``RequestMeta``,
``CallResult``): plain classes rather than dataclasses, because compiled (``make build``)
their constructors cost much less than a dataclass's, with the equality and the repr a
dataclass would give them."""

from __future__ import annotations

from typing import ClassVar

__all__ = ["Plain"]


class Plain:
    """Equality and repr from the attributes named by ``_NAMES`` (a subclass's fields, in
    its constructor's order; its ``__slots__`` too)."""

    __slots__ = ()
    _NAMES: ClassVar[tuple[str, ...]] = ()

    def _fields(self) -> tuple[object, ...]:
        return tuple([getattr(self, name) for name in self._NAMES])

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self) or not isinstance(other, Plain):
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        shown = ", ".join(f"{n}={v!r}" for n, v in zip(self._NAMES, self._fields(), strict=True))
        return f"{type(self).__name__}({shown})"
