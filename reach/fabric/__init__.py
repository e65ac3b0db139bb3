"""Starting a fabric: servers, token issuer, login gates and registrar (see ``Fabric``).

``reach.fabric.services.FabricServices`` is the registrar part alone, in this process.

The names below are imported on first use, so that importing one module of the package
(``reach.fabric.embedded``, which ``reach.testing`` builds on) does not load the
registrar, the security services and NATS.
"""

import typing as _typing

from reach import lazy as _lazy

if _typing.TYPE_CHECKING:
    from reach.fabric.root import Fabric as Fabric
    from reach.fabric.root import RegistrarPart as RegistrarPart

#: each public name and the module it is imported from
_EXPORTS: dict[str, str] = {
    "Fabric": "reach.fabric.root",
    "RegistrarPart": "reach.fabric.root",
}
__all__ = list(_EXPORTS)

if not _typing.TYPE_CHECKING:  # type checkers read the imports above instead
    __getattr__, __dir__ = _lazy.exports(__name__, _EXPORTS, globals(), __all__)
