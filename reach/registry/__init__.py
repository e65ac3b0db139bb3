"""The registry: records in JetStream KV, the registrar that keeps them, the caches reading them."""

from reach.registry.registrar import Registrar, RegistrarConfig
from reach.registry.routecache import RouteCache
from reach.registry.store import RegistryStore

__all__ = ["Registrar", "RegistrarConfig", "RegistryStore", "RouteCache"]
