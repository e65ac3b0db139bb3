"""The heartbeat partition of an agent id, computed as nats-server's subject mapping does.

Every server config reach writes maps ``reach.v1.hb.<agent_id>`` to
``reach.v1.hbp.<partition>.<agent_id>`` with ``{{partition(N,1)}}``
(``subjects.HEARTBEAT_MAPPING``): nats-server hashes the agent id token with 32-bit
FNV-1a and takes it modulo N (``server/subject_transform.go``, ``getHashPartition``).
A registrar computes the same number for an instance, so the registrar that receives an
instance's heartbeats is the one that judges its silence. No I/O.
"""

from __future__ import annotations

import functools

from reach.wire import subjects

__all__ = ["fnv1a32", "partition_of", "partition_token"]

_FNV_OFFSET = 0x811C9DC5
_FNV_PRIME = 0x01000193


def fnv1a32(data: bytes) -> int:
    """32-bit FNV-1a of ``data`` (Go's ``hash/fnv.New32a``)."""
    h = _FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * _FNV_PRIME) & 0xFFFFFFFF
    return h


@functools.lru_cache(maxsize=1 << 18)
def partition_of(agent_id: str, partitions: int = subjects.HEARTBEAT_PARTITIONS) -> int:
    """The partition nats-server maps the heartbeats of ``agent_id`` to (remembered for
    the most recent agent ids: every heartbeat and every sweep asks)."""
    return fnv1a32(agent_id.encode()) % partitions


def partition_token(subject: str) -> int | None:
    """The partition of a subject ``reach.v1.hbp.<partition>.<agent_id>``; None for a
    subject of another shape (a heartbeat on ``reach.v1.hb.<agent_id>``, not mapped)."""
    prefix = subjects.HEARTBEAT_PARTITION_PREFIX + "."
    if not subject.startswith(prefix):
        return None
    token = subject[len(prefix) :].split(".", 1)[0]
    if not token.isdigit() or len(token) > 6:
        return None
    return int(token)
