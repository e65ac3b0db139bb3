"""The registry: records in JetStream KV, the registrar that keeps them, the caches reading them.

The names below are imported on first use: a caller that imports the route cache
(``reach.registry.routecache``) does not load the registrar with it.
"""

import typing as _typing

from reach import lazy as _lazy

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
    __getattr__, __dir__ = _lazy.exports(__name__, _EXPORTS, globals(), __all__)
