"""Registry records in the JetStream KV bucket REACH_REGISTRY, written with compare-and-set."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgpack
from pydantic import ValidationError

from reach import codec, subjects
from reach.errors import CodecError
from reach.modelcodec import encode_model, validate_record
from reach.models import Instance, Manifest, RegistrarRecord
from reach.transport import Connection, KVBucket

__all__ = ["RecordChange", "RegistryStore", "decode_instance"]

log = logging.getLogger("reach.registry")


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


class RegistryStore:
    """Typed access to REACH_REGISTRY: ``agent.<agent_id>`` and ``registrar.<id>`` keys."""

    def __init__(self, bucket: KVBucket) -> None:
        self.bucket = bucket

    @classmethod
    async def open(
        cls, conn: Connection, *, create: bool = True, replicas: int = 1
    ) -> RegistryStore:
        bucket = await conn.key_value(
            subjects.REGISTRY_BUCKET, create=create, replicas=replicas, public=True
        )
        return cls(bucket)

    async def get(self, agent_id: str) -> tuple[Instance, int] | None:
        entry = await self.bucket.get(subjects.agent_key(agent_id))
        if entry is None or not entry.value:
            return None
        return decode_instance(entry.value), entry.revision

    async def create(self, instance: Instance) -> int:
        return await self.bucket.create(
            subjects.agent_key(instance.agent_id), encode_model(instance)
        )

    async def update(self, instance: Instance, last: int) -> int:
        return await self.bucket.update(
            subjects.agent_key(instance.agent_id), encode_model(instance), last
        )

    async def delete(self, agent_id: str, last: int | None = None) -> None:
        await self.bucket.delete(subjects.agent_key(agent_id), last=last)

    async def put_registrar(self, record: RegistrarRecord) -> None:
        await self.bucket.put(
            subjects.registrar_key(record.registrar_id),
            codec.encode(record.model_dump(mode="json"), checked=False),
        )

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

    async def watch(self) -> AsyncIterator[RecordChange | None]:
        """Every record, then ``None`` once caught up, then every change; bad records skipped."""
        async for entry in self.bucket.watch(">"):
            if entry is None:
                yield None
                continue
            change = _to_change(entry.key, entry.revision, entry.value, entry.deleted)
            if change is not None:
                yield change


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
