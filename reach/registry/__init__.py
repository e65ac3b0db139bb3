"""The registry: instance records in JetStream KV and the registrar that keeps them
(callers read them through their route cache, ``reach.caller.routecache``).

The names below are imported on first use.
"""

import typing as _typing

from reach import lazy as _lazy

if _typing.TYPE_CHECKING:
    from reach.registry.config import RegistrarConfig as RegistrarConfig
    from reach.registry.registrar import Registrar as Registrar
    from reach.registry.store import RegistryStore as RegistryStore

#: each public name and the module it is imported from
_EXPORTS: dict[str, str] = {
    "Registrar": "reach.registry.registrar",
    "RegistrarConfig": "reach.registry.config",
    "RegistryStore": "reach.registry.store",
}
__all__ = list(_EXPORTS)

if not _typing.TYPE_CHECKING:  # type checkers read the imports above instead
    __getattr__, __dir__ = _lazy.exports(__name__, _EXPORTS, globals(), __all__)
