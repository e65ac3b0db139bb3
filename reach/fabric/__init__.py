"""Starting a fabric: servers, token issuer, login gates and registrar (see ``Fabric``).

``reach.fabric.services.FabricServices`` is the registrar part alone, in this process.
"""

from reach.fabric.root import Fabric, RegistrarPart

__all__ = ["Fabric", "RegistrarPart"]
