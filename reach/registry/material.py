"""Which changes a heartbeat brings are worth a registry write: those a caller routes on.

A heartbeat renews an instance's liveness at the registrar that owns it (in memory, see
:mod:`reach.registry.health`); its record is rewritten only when something the router
reads of it (``Instance.routing_facts``, ``reach.caller.routing``) changed materially, so route
caches see changes, not renewals. The score is

    0.4·health + 0.3·latency term + 0.2·(1 − load) + 0.1·stability

and of the record it reads the health status, the stability (from the manifest, which a
heartbeat never changes), ``in_flight`` and ``max_concurrency``. The latency term is the
caller's own observation. So a heartbeat is written when:

- the status changes (healthy, degraded, unhealthy), or readiness turns ready or not
  ready, or its reason changes (shown by every tool and the cause of a degraded status);
- ``max_concurrency`` changes;
- the load share ``in_flight / max_concurrency`` moved by ``LOAD_STEP`` or more since
  the record was written: the load term then moves by 0.2 × 0.1 = 0.02 or more, while a
  smaller drift moves it less than ``reach.caller.routing.TIE_BAND`` (0.025), the band inside
  which instances count as equally good, so no unwritten drift alone takes an instance in
  or out of the band of the best;
- the load crosses saturation (``in_flight`` reaching ``max_concurrency``, or dropping
  below it): a saturated instance must be seen as such however small the step.

Everything else a heartbeat reports (completed calls, memory, the readiness gauges) is
written along with the next material change.
"""

from __future__ import annotations

from reach.wire.models import HealthStatus, Instance, Readiness

__all__ = ["LOAD_STEP", "material_change"]

#: the change of load share (in_flight / max_concurrency) that is written
LOAD_STEP = 0.1


def material_change(
    written: Instance,
    *,
    status: HealthStatus,
    readiness: Readiness,
    in_flight: int,
    max_concurrency: int,
) -> str:
    """Why a heartbeat that leaves the instance with these figures must be written over
    ``written`` (the record as it is in the registry); "" if routing would not tell the
    two apart. Compares a few numbers: it runs on every heartbeat."""
    if status != written.status:
        return "status"
    known = written.readiness
    if readiness.ready != known.ready or readiness.reason != known.reason:
        return "readiness"
    before = written.max_concurrency
    if max_concurrency != before:
        return "max_concurrency"
    if (in_flight >= max_concurrency) != (written.in_flight >= before):
        return "saturation"
    if abs(in_flight - written.in_flight) >= LOAD_STEP * (max_concurrency or 1) - 1e-9:
        return "load"
    return ""
