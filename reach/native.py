"""Whether this install runs the compiled call path, and whether it is out of date.

``make build`` compiles the call path's modules with mypyc (setup.py lists them) into
extension modules next to their sources; Python then imports those instead of the
``.py`` files. A source edited after the build is not what runs until the next build:
``stale_sources`` names such files, so the test suite and the benchmarks can refuse to
measure old code.
"""

from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path

__all__ = ["compiled_modules", "stale_message", "stale_sources"]

_PACKAGE = Path(__file__).resolve().parent


def _extensions() -> list[Path]:
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    return [p for p in _PACKAGE.rglob("*") if p.name.endswith(suffixes)]


def compiled_modules() -> list[str]:
    """The ``reach`` modules imported so far that run compiled, by name."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    return sorted(
        name
        for name, module in list(sys.modules.items())
        if name.startswith("reach.")
        and not name.endswith("__mypyc")
        and str(getattr(module, "__file__", "") or "").endswith(suffixes)
    )


def stale_sources() -> list[str]:
    """Sources changed since the compiled modules were built (empty when there are no
    compiled modules: plain Python is never stale)."""
    built = _extensions()
    if not built:
        return []
    oldest = min(p.stat().st_mtime for p in built)
    return sorted(
        str(p.relative_to(_PACKAGE.parent))
        for p in _PACKAGE.rglob("*.py")
        if p.stat().st_mtime > oldest
    )


def stale_message() -> str | None:
    """What to tell whoever is about to test or measure stale compiled modules (None when
    nothing is stale)."""
    stale = stale_sources()
    if not stale:
        return None
    more = " …" if len(stale) > 5 else ""
    return (
        f"the compiled call path is older than {', '.join(stale[:5])}{more}:"
        " run `make build` (or `make pure` to run plain Python)"
    )
