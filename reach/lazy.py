"""Lazy public names for a package's ``__init__``: ``from reach import Agent`` imports
``reach.agent.agent`` when the name is first used, so ``import reach`` (and a process that
needs one part) loads no more than it uses."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

__all__ = ["exports"]


def exports(
    package: str,
    names: Mapping[str, str],
    namespace: MutableMapping[str, Any],
    public: Sequence[str],
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose public ``names`` (name →
    the module that defines it) are imported on first use into ``namespace`` (the
    package's globals), after which each is an attribute like any other."""

    def getattr_(name: str) -> object:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(public))

    return getattr_, dir_
