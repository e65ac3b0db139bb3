"""``reach console``: the fabric on one web page (docs/console.md).

The registry, the calls of the last minutes, the alerts and the audit trail, read with
the operator's credentials and shown as server-rendered pages whose live parts are sent
again over server-sent events. It reads only: it offers nothing its credential may not do.
"""

from reach.console.app import Console
from reach.console.state import FabricView

__all__ = ["Console", "FabricView"]
