"""JetStream KV buckets: compare-and-set writes, and watches that end when the connection
comes back (a restarted server may have lost their consumer).

A public bucket (one callers read) is followed without a consumer (``kvfollow``); a
bucket of secrets is watched with an ordered consumer, as admins do.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as _NatsClient
from nats.js.api import KeyValueConfig, RePublish, StorageType, StreamConfig
from nats.js.kv import KeyValue

from reach.errors import ConfigurationError, Disconnected, PermissionDenied, ReachError
from reach.transport import kvfollow
from reach.transport.denials import Denials, api_refusal_of
from reach.transport.kvfollow import KVEntry, republish_prefix

__all__ = ["KVBucket", "KVConflict", "KVEntry", "ReconnectEvents", "open_bucket"]

#: a connection's reconnect events: an event set on every reconnect, and the function
#: that stops setting it
ReconnectEvents = Callable[[], tuple[asyncio.Event, Callable[[], None]]]


class KVConflict(ReachError):
    """A compare-and-set write lost: the key changed (or exists) since it was read."""

    layer = "discovery"


_RECONNECTED = object()
_ENDED = object()


def _noop() -> None:
    return None


def _no_reconnects() -> tuple[asyncio.Event, Callable[[], None]]:
    return asyncio.Event(), _noop


async def _next_unless(entries: AsyncIterator[Any], reconnected: asyncio.Event) -> Any:
    """The next item of ``entries``; ``_RECONNECTED`` if ``reconnected`` is set first,
    ``_ENDED`` when they end."""
    following = asyncio.ensure_future(anext(entries))
    back = asyncio.ensure_future(reconnected.wait())
    try:
        await asyncio.wait({following, back}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled: the read goes too
        following.cancel()
        raise
    finally:
        back.cancel()
    if not following.done():
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
            await following
        return _RECONNECTED
    try:
        return following.result()
    except StopAsyncIteration:
        return _ENDED


def _republish(bucket: str) -> RePublish:
    return RePublish(src=f"$KV.{bucket}.>", dest=f"{republish_prefix(bucket)}.>")


def _is_public(config: StreamConfig, bucket: str) -> bool:
    republish = config.republish
    return bool(
        config.allow_direct
        and republish is not None
        and republish.dest == f"{republish_prefix(bucket)}.>"
        and republish.src in (None, f"$KV.{bucket}.>")
        and not republish.headers_only
    )


def _is_conflict(exc: BaseException) -> bool:
    if isinstance(exc, nats.js.errors.KeyWrongLastSequenceError):
        return True
    return isinstance(exc, nats.js.errors.APIError) and exc.err_code in (10071, 10164)


class KVBucket:
    """JetStream KV operations with compare-and-set, translated to Agent-Reach errors."""

    def __init__(
        self,
        name: str,
        kv: Any,
        denials: Denials | None = None,
        follower: _NatsClient | None = None,
        reconnects: ReconnectEvents | None = None,
    ) -> None:
        self._denials = denials or Denials()
        self.name = name
        self._kv = kv
        #: the client that follows this public bucket without a consumer (None: it is
        #: watched with an ordered consumer, as a bucket of secrets is by admins)
        self._follower = follower
        #: the bucket's connection's reconnects: a watch ends (or scans again) on each
        self._reconnects = reconnects or _no_reconnects

    async def get(self, key: str) -> KVEntry | None:
        started = time.monotonic()
        try:
            entry = await self._kv.get(key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        except Exception as exc:
            raise self._denials.explain(
                exc, started=started, what=f"KV get {self.name}/{key}"
            ) from exc
        return KVEntry(key, bytes(entry.value or b""), int(entry.revision))

    async def create(self, key: str, value: bytes) -> int:
        """Write only if the key does not exist; KVConflict otherwise."""
        started = time.monotonic()
        try:
            return int(await self._kv.create(key, value))
        except Exception as exc:
            if _is_conflict(exc):
                raise KVConflict(f"{self.name}/{key} already exists") from exc
            raise await self._denials.explain_write(
                exc, started=started, what=f"KV create {self.name}/{key}"
            ) from exc

    async def update(self, key: str, value: bytes, last: int) -> int:
        """Write only if the key is still at revision ``last``; KVConflict otherwise."""
        started = time.monotonic()
        try:
            return int(await self._kv.update(key, value, last=last))
        except Exception as exc:
            if _is_conflict(exc):
                raise KVConflict(f"{self.name}/{key} changed since revision {last}") from exc
            raise await self._denials.explain_write(
                exc, started=started, what=f"KV update {self.name}/{key}"
            ) from exc

    async def put(self, key: str, value: bytes) -> int:
        started = time.monotonic()
        try:
            return int(await self._kv.put(key, value))
        except Exception as exc:
            raise await self._denials.explain_write(
                exc, started=started, what=f"KV put {self.name}/{key}"
            ) from exc

    async def delete(self, key: str, last: int | None = None) -> None:
        """Delete (only if still at revision ``last`` when given); KVConflict otherwise."""
        started = time.monotonic()
        try:
            await self._kv.delete(key, last=last)
        except Exception as exc:
            if _is_conflict(exc):
                raise KVConflict(f"{self.name}/{key} changed since revision {last}") from exc
            raise await self._denials.explain_write(
                exc, started=started, what=f"KV delete {self.name}/{key}"
            ) from exc

    async def key_names(self, keys: str) -> list[str]:
        """The keys matching ``keys`` that have an entry (deleted ones included), from the
        stream's subject counts: one request, no value read. The server lists a bounded
        number of subjects: for a very large bucket, some are missing."""
        started = time.monotonic()
        prefix = f"$KV.{self.name}."
        try:
            info = await self._kv._js.stream_info(
                f"KV_{self.name}", subjects_filter=f"{prefix}{keys}"
            )
        except Exception as exc:
            raise self._denials.explain(
                exc, started=started, what=f"KV keys {self.name}/{keys}"
            ) from exc
        found = info.state.subjects or {}
        return [s[len(prefix) :] for s in found if s.startswith(prefix)]

    async def watch(self, keys: str) -> AsyncIterator[KVEntry | None]:
        """Current values, then ``None`` once caught up, then every change (deletes flagged)."""
        if self._follower is not None:
            async for change in self._follow(self._follower, keys):
                yield change
            return
        started = time.monotonic()
        try:
            watcher = await self._kv.watch(keys)
        except Exception as exc:
            raise self._denials.explain(
                exc, started=started, what=f"KV watch {self.name}/{keys}"
            ) from exc
        # after a reconnect the server may have lost the consumer (a restart) and nats-py
        # notices only when its heartbeats stay away for a while: the watch ends at once
        # instead, and its reader watches again
        reconnected, forget = self._reconnects()
        entries = aiter(watcher)
        try:
            while True:
                entry = await _next_unless(entries, reconnected)
                if entry is _RECONNECTED:
                    raise Disconnected(
                        f"KV watch {self.name}/{keys} ended: the connection came back; watch again"
                    )
                if entry is _ENDED:
                    return
                if entry is None:
                    yield None
                    continue
                deleted = entry.operation in ("DEL", "PURGE")
                yield KVEntry(entry.key, bytes(entry.value or b""), int(entry.revision), deleted)
        finally:
            forget()
            with contextlib.suppress(Exception):
                await watcher.stop()

    async def _follow(self, nc: _NatsClient, keys: str) -> AsyncIterator[KVEntry | None]:
        started = time.monotonic()
        reconnected, forget = self._reconnects()
        try:
            async for change in kvfollow.follow(nc, self.name, keys, reconnected):
                yield change
        except (kvfollow.ScanError, TimeoutError, nats.errors.Error) as exc:
            raise self._denials.explain(
                exc, started=started, what=f"KV watch {self.name}/{keys}"
            ) from exc
        finally:
            forget()


async def open_bucket(
    js: Any,
    denials: Denials,
    bucket: str,
    *,
    follower: _NatsClient,
    reconnects: ReconnectEvents,
    create: bool,
    replicas: int,
    history: int,
    ttl: float | None,
    public: bool,
    direct_gets: bool,
) -> KVBucket:
    """The KV ``bucket`` (see ``Connection.key_value``): opened through ``js``, created
    with ``create`` if it does not exist; a public one is followed by ``follower``."""
    started = time.monotonic()
    stream = f"KV_{bucket}"
    try:
        info = await denials.guard(
            js.stream_info(stream),
            f"open KV bucket {bucket}",
            api_refusal_of("STREAM.INFO", stream),
        )
    except PermissionDenied:
        raise
    except nats.js.errors.NotFoundError:
        if not create:
            raise ConfigurationError(f"KV bucket {bucket} does not exist") from None
        config = KeyValueConfig(
            bucket=bucket,
            history=history,
            replicas=replicas,
            ttl=ttl,
            storage=StorageType.FILE,
            direct=public,
            republish=_republish(bucket) if public else None,
        )
        try:
            await js.create_key_value(config)
        except Exception as exc:
            raise denials.explain(exc, f"create KV bucket {bucket}", started) from exc
        follow = public
    except Exception as exc:
        raise denials.explain(exc, f"open KV bucket {bucket}", started) from exc
    else:
        follow = _is_public(info.config, bucket)
        if public and create and not follow:
            await _make_public(js, denials, info.config, bucket, started)
            follow = True
    # gets go to the stream leader, not to direct gets answered by any replica (a
    # replica still catching up would report records as missing), unless asked:
    # ``direct_gets``, where readers may read only some keys, and NATS permissions
    # can name a key only in a direct get's subject
    kv = KeyValue(bucket, stream, f"$KV.{bucket}.", js, direct_gets and follow)
    return KVBucket(bucket, kv, denials, follower if follow else None, reconnects)


async def _make_public(
    js: Any, denials: Denials, config: StreamConfig, bucket: str, started: float
) -> None:
    config.allow_direct = True
    config.republish = _republish(bucket)
    try:
        await js.update_stream(config)
    except Exception as exc:
        raise denials.explain(exc, f"update KV bucket {bucket}", started) from exc
