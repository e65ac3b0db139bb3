"""REACH_KEYS: the public verification keys (``pub.<kid>``) every verifier follows, and
the revocations (``revoked.<client_id>``) it follows with them. Private keys never go here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Final

from pydantic import ValidationError

from reach.clock import Clock, system_clock
from reach.errors import CodecError, ConfigurationError
from reach.security.claims import DEFAULT_LEEWAY_SEC
from reach.security.revocation import REVOKED_PREFIX, decode_revocation
from reach.security.signingkeys import KID_PATTERN, KeyRing, PublicKey, SigningKey
from reach.security.tokenverifier import TokenVerifier
from reach.transport import Connection, KVBucket, KVEntry
from reach.wire import codec, subjects

__all__ = ["KeyChange", "KeyStore"]

log = logging.getLogger("reach.security")

_KEY_PREFIX: Final = "pub."


@dataclass(frozen=True, slots=True)
class KeyChange:
    """One change seen on REACH_KEYS: a key published (or updated), or removed (key=None)."""

    kid: str
    key: PublicKey | None


def _encode_public(pub: PublicKey) -> bytes:
    return codec.encode(pub.model_dump(mode="json"), checked=False)


def _decode_public(data: bytes) -> PublicKey:
    try:
        pub = PublicKey.model_validate(codec.decode(data))
        pub.key()
    except (ValidationError, ConfigurationError) as exc:
        raise CodecError(f"not a valid public key record: {exc}") from None
    return pub


def _key_change(entry: KVEntry) -> KeyChange | None:
    """What a ``pub.<kid>`` record says; None (logged) if it cannot be read."""
    kid = entry.key[len(_KEY_PREFIX) :]
    if entry.deleted or not entry.value:
        return KeyChange(kid, None)
    try:
        pub = _decode_public(entry.value)
    except CodecError as exc:
        log.warning("skipping key record %s: %s", entry.key, exc)
        return None
    if pub.kid != kid:
        log.warning("skipping key record %s: it names kid %s", entry.key, pub.kid)
        return None
    return KeyChange(kid, pub)


def _follow_revocation(verifier: TokenVerifier, entry: KVEntry) -> None:
    client_id = entry.key[len(REVOKED_PREFIX) :]
    if entry.deleted or not entry.value:
        verifier.unrevoke(client_id)
        return
    try:
        revocation = decode_revocation(entry.value)
    except CodecError as exc:
        log.warning("skipping revocation record %s: %s", entry.key, exc)
        return
    if revocation.client_id != client_id:
        log.warning("skipping revocation record %s: it names %s", entry.key, revocation.client_id)
        return
    verifier.revoke(client_id, revocation.revoked_at)


class KeyStore:
    """Public verification keys in REACH_KEYS (key ``pub.<kid>``); private keys never go here."""

    def __init__(self, bucket: KVBucket, *, clock: Clock = system_clock) -> None:
        self.bucket = bucket
        self._clock = clock

    @classmethod
    async def open(
        cls,
        conn: Connection,
        *,
        create: bool = True,
        replicas: int = 1,
        clock: Clock = system_clock,
    ) -> KeyStore:
        bucket = await conn.key_value(
            subjects.KEYS_BUCKET, create=create, replicas=replicas, public=True
        )
        return cls(bucket, clock=clock)

    async def publish(self, pub: PublicKey) -> None:
        await self.bucket.put(_KEY_PREFIX + pub.kid, _encode_public(pub))

    async def publish_ring(self, ring: KeyRing) -> None:
        """Publish every public key of ``ring`` (others' keys in the bucket are left alone)."""
        for pub in ring.public_keys():
            await self.publish(pub)

    async def get(self, kid: str) -> PublicKey | None:
        if not KID_PATTERN.fullmatch(kid):
            return None
        entry = await self.bucket.get(_KEY_PREFIX + kid)
        if entry is None or not entry.value:
            return None
        return _decode_public(entry.value)

    async def delete(self, kid: str) -> None:
        await self.bucket.delete(_KEY_PREFIX + kid)

    async def all(self) -> list[PublicKey]:
        """Every published key; unreadable records are skipped (and logged)."""
        keys: list[PublicKey] = []
        async with contextlib.aclosing(self.watch()) as changes:
            async for change in changes:
                if change is None:
                    break
                if change.key is not None:
                    keys.append(change.key)
        return keys

    async def prune(self) -> list[str]:
        """Delete retired keys whose tokens have all expired; returns their kids."""
        now = self._clock.time()
        gone = [pub.kid for pub in await self.all() if pub.expired(now)]
        for kid in gone:
            await self.delete(kid)
        return gone

    async def watch(self) -> AsyncGenerator[KeyChange | None, None]:
        """Every key, then ``None`` once caught up, then every change."""
        async for entry in self.bucket.watch(_KEY_PREFIX + "*"):
            if entry is None:
                yield None
                continue
            change = _key_change(entry)
            if change is not None:
                yield change

    async def follow(self, verifier: TokenVerifier, ready: asyncio.Event | None = None) -> None:
        """Keep ``verifier``'s keys and revocations equal to the bucket's until cancelled
        (run it as a task); ``ready`` is set once the current ones are loaded. Returns if
        the watch ends."""
        # one watch of the whole bucket: a revocation reaches the verifier as fast as a key
        async for entry in self.bucket.watch(">"):
            if entry is None:
                if ready is not None:
                    ready.set()
            elif entry.key.startswith(REVOKED_PREFIX):
                _follow_revocation(verifier, entry)
            elif entry.key.startswith(_KEY_PREFIX) and (change := _key_change(entry)):
                if change.key is None:
                    verifier.remove_key(change.kid)
                else:
                    verifier.add_key(change.kid, change.key)

    async def rotate(
        self,
        ring: KeyRing,
        token_ttl: float,
        *,
        settle_sec: float = 1.0,
        leeway: float = DEFAULT_LEEWAY_SEC,
    ) -> SigningKey:
        """Rotate without failed verifications: publish the next key, let verifiers learn
        it for ``settle_sec``, then sign with it and publish the old one as retired."""
        staged = ring.stage()
        await self.publish(staged.public())
        if settle_sec > 0:
            await asyncio.sleep(settle_sec)
        new = ring.rotate(token_ttl, leeway=leeway)
        await self.publish_ring(ring)
        return new
