"""The registry: records in JetStream KV, the registrar that keeps them, the caches reading them.

The names below are imported on first use: a caller that imports the route cache
(``reach.registry.routecache``) does not load the registrar with it.
"""

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from reach.registry.config import RegistrarConfig
    from reach.registry.registrar import Registrar
    from reach.registry.routecache import RouteCache
    from reach.registry.store import RegistryStore

__all__ = ["Registrar", "RegistrarConfig", "RegistryStore", "RouteCache"]

#: each public name and the module it is imported from
_EXPORTS: dict[str, str] = {
    "Registrar": "reach.registry.registrar",
    "RegistrarConfig": "reach.registry.config",
    "RegistryStore": "reach.registry.store",
    "RouteCache": "reach.registry.routecache",
}

if not _typing.TYPE_CHECKING:  # type checkers read the imports above instead

    def __getattr__(name: str) -> object:
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module 'reach.registry' has no attribute {name!r}")
        value = getattr(_importlib.import_module(module), name)
        globals()[name] = value  # once imported, an attribute like any other
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
