"""Registry records in the JetStream KV bucket REACH_REGISTRY, written with compare-and-set.

Every instance record ``agent.<agent_id>`` has a route key ``cap.<capability>.<agent_id>``
for each capability it serves, holding the same bytes: a caller's route cache follows
only the ``cap.<capability>.>`` prefixes of the capabilities it uses, so record traffic
of other capabilities never reaches it. The instance record stays the authority (it is
written with compare-and-set, its route keys after it); a registrar that dies between
the two leaves route keys behind or missing, and the registrars' registry watch repairs
what stays so for ``ROUTE_REPAIR_AFTER_SEC`` (``RouteRepair``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
from pydantic import ValidationError

from reach.errors import CodecError, ConfigurationError, DiscoveryError, ReachError
from reach.registry.routerepair import RouteRepair
from reach.transport import Connection, KVBucket
from reach.wire import codec, subjects
from reach.wire.modelcodec import encode_model, validate_record
from reach.wire.models import Instance, Manifest, RegistrarRecord

__all__ = [
    "ROUTE_KEY_PREFIX",
    "RecordChange",
    "RegistryStore",
    "RouteChange",
    "decode_instance",
    "route_key",
]

log = logging.getLogger("reach.registry")

#: route keys: ``cap.<capability>.<agent_id>``, a copy of the instance record per capability
ROUTE_KEY_PREFIX = "cap."


def route_key(capability: str, agent_id: str) -> str:
    return f"{ROUTE_KEY_PREFIX}{capability}.{agent_id}"


def route_keys(capability: str) -> str:
    """The key filter of every route key of ``capability``."""
    return f"{ROUTE_KEY_PREFIX}{capability}.>"


#: manifests already validated, by their packed bytes: a heartbeat rewrites an agent's
#: record with the same manifest, and validating one (capabilities, their JSON Schemas)
#: costs several times what the rest of the record does. Least recently used go first.
_MANIFESTS: OrderedDict[bytes, Manifest] = OrderedDict()
_MANIFESTS_MAX = 20_000


def decode_instance(data: bytes) -> Instance:
    """Decode a KV value; CodecError if it is not an Instance record.

    Every route cache and registrar decodes every change, most of them heartbeats: the
    manifest of a record is validated once and reused while it stays the same."""
    # no walk for depth and element counts (a large share of decoding a record): only
    # registrars may write the bucket, the unpacker still bounds sizes and refuses non-str
    # keys and extension types, and the models below check every field
    value = codec.decode(data, checked=False)
    manifest = value.get("manifest") if type(value) is dict else None
    if type(manifest) is dict:
        value = {**value, "manifest": _known_manifest(manifest)}
    return validate_record(Instance, value, "registry")


def _known_manifest(raw: dict[str, Any]) -> Manifest:
    """The validated manifest of ``raw`` (as unpacked), validated on first sight only."""
    key = msgpack.packb(raw, use_bin_type=True)  # it was unpacked: it packs
    known = _MANIFESTS.get(key)
    if known is not None:
        _MANIFESTS.move_to_end(key)
        return known
    try:
        known = Manifest.model_validate(raw)
    except ValidationError as exc:
        raise CodecError(
            f"registry record is not a valid Instance: manifest: {exc.errors()[0]['msg']}"
        ) from None
    _MANIFESTS[key] = known
    if len(_MANIFESTS) > _MANIFESTS_MAX:
        _MANIFESTS.popitem(last=False)
    return known


@dataclass(frozen=True, slots=True)
class RecordChange:
    """One change seen on the registry watch: an instance (or None when deleted), or a registrar."""

    key: str
    revision: int
    instance: Instance | None = None
    registrar: RegistrarRecord | None = None
    deleted: bool = False

    @property
    def agent_id(self) -> str:
        return self.key[len(subjects.AGENT_KEY_PREFIX) :]


@dataclass(frozen=True, slots=True)
class RouteChange:
    """One change of a route key: the instance serving ``capability`` (None: removed)."""

    capability: str
    agent_id: str
    revision: int
    instance: Instance | None = None


class RegistryStore:
    """Typed access to REACH_REGISTRY: ``agent.<agent_id>``, ``registrar.<id>`` and the
    route keys ``cap.<capability>.<agent_id>``.

    ``repair``: its ``watch`` also repairs route keys left out of step with their
    instance record (a registrar's store: ``open`` with ``create``)."""

    def __init__(self, bucket: KVBucket, *, repair: bool = False) -> None:
        self.bucket = bucket
        #: agent id → revision and capabilities of its record, as last written or seen:
        #: which route keys an update or a delete leaves behind
        self._caps: dict[str, tuple[int, frozenset[str]]] = {}
        self.repair: RouteRepair | None = RouteRepair(self) if repair else None

    @classmethod
    async def open(
        cls, conn: Connection, *, create: bool = True, replicas: int = 1
    ) -> RegistryStore:
        bucket = await conn.key_value(
            subjects.REGISTRY_BUCKET, create=create, replicas=replicas, public=True
        )
        return cls(bucket, repair=create)

    @classmethod
    async def existing(cls, conn: Connection, servers: Sequence[str]) -> RegistryStore:
        """The registry of the fabric at ``servers``, which must be there already:
        DiscoveryError asking whether ``reach up`` runs when it is not."""
        try:
            return await cls.open(conn, create=False)
        except ConfigurationError:
            raise DiscoveryError(
                f"no registry at {', '.join(servers)}: is `reach up` running?"
            ) from None

    async def get(self, agent_id: str) -> tuple[Instance, int] | None:
        entry = await self.bucket.get(subjects.agent_key(agent_id))
        if entry is None or not entry.value:
            return None
        instance = decode_instance(entry.value)
        self._caps[agent_id] = (entry.revision, _capabilities(instance))
        return instance, entry.revision

    async def create(self, instance: Instance) -> int:
        data = encode_model(instance)
        revision = await self.bucket.create(subjects.agent_key(instance.agent_id), data)
        await self._write_routes(instance, revision, data, frozenset())
        return revision

    async def update(self, instance: Instance, last: int) -> int:
        data = encode_model(instance)
        before = await self._capabilities_at(instance.agent_id, last)
        revision = await self.bucket.update(subjects.agent_key(instance.agent_id), data, last)
        await self._write_routes(instance, revision, data, before)
        return revision

    async def delete(self, agent_id: str, last: int | None = None) -> None:
        before = await self._capabilities_at(agent_id, last)
        await self.bucket.delete(subjects.agent_key(agent_id), last=last)
        self._caps.pop(agent_id, None)
        await self._route_writes(agent_id, [], [route_key(c, agent_id) for c in before])

    async def _capabilities_at(self, agent_id: str, last: int | None) -> frozenset[str]:
        """The capabilities of the record at revision ``last`` (the current one if None):
        remembered, or read. Empty if the record is elsewhere (the write will conflict)."""
        known = self._caps.get(agent_id)
        if known is not None and (last is None or known[0] == last):
            return known[1]
        try:
            found = await self.get(agent_id)
        except CodecError:
            return frozenset()
        if found is None or (last is not None and found[1] != last):
            return frozenset()
        return _capabilities(found[0])

    async def _write_routes(
        self, instance: Instance, revision: int, data: bytes, before: frozenset[str]
    ) -> None:
        """The route keys of ``instance`` (written at ``revision`` as ``data``); those of
        the capabilities ``before`` it no longer serves deleted."""
        agent_id = instance.agent_id
        now = _capabilities(instance)
        self._caps[agent_id] = (revision, now)
        puts = [(route_key(c, agent_id), data) for c in sorted(now)]
        await self._route_writes(agent_id, puts, [route_key(c, agent_id) for c in before - now])

    async def _route_writes(
        self, agent_id: str, puts: list[tuple[str, bytes]], deletes: list[str]
    ) -> None:
        """The instance record is written: a route key that fails now is repaired later
        (``RouteRepair``), it does not fail the record's write."""
        results = await asyncio.gather(
            *(self.bucket.put(key, data) for key, data in puts),
            *(self.bucket.delete(key) for key in deletes),
            return_exceptions=True,
        )
        for failure in results:
            if isinstance(failure, ReachError):
                log.warning("route key of %s not written (%s): repaired later", agent_id, failure)
            elif isinstance(failure, BaseException):
                raise failure

    async def repair_routes(self, agent_id: str, present: tuple[str, ...]) -> None:
        """Rewrite the route keys of ``agent_id`` from its record as it is now (the
        capabilities in ``present`` have route keys); delete them if it has none."""
        entry = await self.bucket.get(subjects.agent_key(agent_id))
        instance = None
        if entry is not None and entry.value:
            instance = _route_instance(entry.key, entry.revision, entry.value)
        if entry is None or instance is None:
            await self._route_writes(agent_id, [], [route_key(c, agent_id) for c in present])
            return
        await self._write_routes(instance, entry.revision, entry.value, frozenset(present))

    async def capability_names(self) -> set[str]:
        """The capabilities with a route key (some served now, some whose instances left)."""
        keys = await self.bucket.key_names(f"{ROUTE_KEY_PREFIX}>")
        return {key.split(".", 2)[1] for key in keys if key.count(".") >= 2}

    async def put_registrar(self, record: RegistrarRecord) -> None:
        await self.bucket.put(subjects.registrar_key(record.registrar_id), record.encode())

    async def delete_registrar(self, registrar_id: str) -> None:
        await self.bucket.delete(subjects.registrar_key(registrar_id))

    async def snapshot(self) -> tuple[list[Instance], list[RegistrarRecord]]:
        """Every instance and registrar record as of now (one watch, read to its end)."""
        instances: list[Instance] = []
        registrars: list[RegistrarRecord] = []
        async for change in self.watch():
            if change is None:
                break
            if change.instance is not None:
                instances.append(change.instance)
            elif change.registrar is not None:
                registrars.append(change.registrar)
        return instances, registrars

    async def watch(self, keys: str = ">") -> AsyncIterator[RecordChange | None]:
        """Every instance and registrar record (of ``keys``), then ``None`` once caught
        up, then every change; bad records and route keys skipped."""
        repair = self.repair
        async for entry in self.bucket.watch(keys):
            if entry is None:
                if repair is not None:
                    repair.caught_up()
                yield None
                continue
            key = entry.key
            if key.startswith(ROUTE_KEY_PREFIX):
                if repair is not None:
                    repair.route_seen(key, entry.value, entry.deleted)
                continue
            change = _to_change(key, entry.revision, entry.value, entry.deleted)
            if change is not None and key.startswith(subjects.AGENT_KEY_PREFIX):
                self._seen(change, entry.value)
            elif repair is not None:
                repair.tick()
            if change is not None:
                yield change

    def _seen(self, change: RecordChange, value: bytes) -> None:
        agent_id = change.agent_id
        caps = _capabilities(change.instance) if change.instance is not None else None
        known = self._caps.get(agent_id)
        if known is None or known[0] < change.revision:
            if caps is None:
                self._caps.pop(agent_id, None)
            else:
                self._caps[agent_id] = (change.revision, caps)
        if self.repair is not None:
            self.repair.agent_seen(agent_id, value if caps is not None else None, caps)

    async def watch_routes(self, capability: str) -> AsyncIterator[RouteChange | None]:
        """The route keys of ``capability``: every current one, then ``None`` once caught
        up, then every change; a record that cannot be read counts as removed."""
        prefix = f"{ROUTE_KEY_PREFIX}{capability}."
        async for entry in self.bucket.watch(route_keys(capability)):
            if entry is None:
                yield None
                continue
            if not entry.key.startswith(prefix):
                continue
            agent_id = entry.key[len(prefix) :]
            instance = None
            if not entry.deleted and entry.value:
                instance = _route_instance(entry.key, entry.revision, entry.value)
            yield RouteChange(capability, agent_id, entry.revision, instance)


def _capabilities(instance: Instance) -> frozenset[str]:
    return frozenset(c.name for c in instance.manifest.capabilities)


def _route_instance(key: str, revision: int, value: bytes) -> Instance | None:
    try:
        return decode_instance(value)
    except CodecError:
        return None
    except Exception:  # one bad record must never end every reader's watch
        log.exception("registry record %s (revision %d) cannot be read: skipped", key, revision)
        return None


def _to_change(key: str, revision: int, value: bytes, deleted: bool) -> RecordChange | None:
    if deleted or not value:
        return RecordChange(key, revision, deleted=True)
    try:
        if key.startswith(subjects.AGENT_KEY_PREFIX):
            return RecordChange(key, revision, instance=decode_instance(value))
        if key.startswith(subjects.REGISTRAR_KEY_PREFIX):
            record = RegistrarRecord.model_validate(codec.decode(value))
            return RecordChange(key, revision, registrar=record)
    except (CodecError, ValidationError):
        return None
    except Exception:  # one bad record must never end every reader's watch
        log.exception("registry record %s (revision %d) cannot be read: skipped", key, revision)
        return None
    return None
