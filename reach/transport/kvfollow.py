"""Following a KV bucket without a JetStream consumer: a scan by direct gets, then the
bucket's changes as the server republishes them on core NATS.

A JetStream consumer is state a client creates on the server and points wherever it
likes: its deliver subject is not held to the creator's subscribe permissions, and a
durable one outlives its creator. A caller that may create consumers can therefore fill
the server with them, or have one deliver registry records into an agent's instance
subject long after it left. So buckets that callers read (``public`` in
``Connection.key_value``) republish every change to ``reach.v1.kv.<bucket>.<key>``
(the server does it, once stored) and allow direct gets, and a reader:

1. subscribes to the republished changes of the keys it follows (a plain subscription:
   what it may read is a subscribe permission, and it leaves nothing behind);
2. scans the bucket with batched direct gets (``$JS.API.DIRECT.GET.<stream>``, read-only,
   answered from the stream's store) and yields the newest entry of every key;
3. yields the republished changes that are newer than what it holds, key by key (each
   carries its stream sequence, the key's revision).

After a reconnect the subscription may have missed changes: it scans again and yields
what differs, deletions of keys that vanished included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as _NatsClient
from nats.aio.msg import Msg as _NatsMsg

__all__ = ["KVEntry", "ScanError", "follow", "republish_prefix", "scan"]

log = logging.getLogger("reach.transport")

#: where the changes of a public bucket are republished: ``<prefix>.<bucket>.<key>``
REPUBLISH_PREFIX = "reach.v1.kv"
#: messages per direct-get batch of a scan
_SCAN_BATCH = 512
#: seconds to wait for the next message of a scan's batch
_SCAN_TIMEOUT = 5.0
_DELETES = ("DEL", "PURGE")


@dataclass(frozen=True, slots=True)
class KVEntry:
    key: str
    value: bytes
    revision: int
    deleted: bool = False


class ScanError(Exception):
    """A direct-get scan of a bucket failed (status and description of the server's answer)."""


def republish_prefix(bucket: str) -> str:
    """The subject prefix the changes of ``bucket`` are republished under."""
    return f"{REPUBLISH_PREFIX}.{bucket}"


def _entry(msg: _NatsMsg, key_prefix: str) -> KVEntry | None:
    headers = msg.headers or {}
    subject = headers.get("Nats-Subject", "")
    if not subject.startswith(key_prefix):
        return None
    try:
        seq = int(headers.get("Nats-Sequence", ""))
    except ValueError:
        return None
    deleted = headers.get("KV-Operation") in _DELETES
    return KVEntry(subject[len(key_prefix) :], bytes(msg.data or b""), seq, deleted)


async def scan(nc: _NatsClient, bucket: str, keys: str) -> dict[str, KVEntry]:
    """The newest entry of every key of ``bucket`` matching ``keys`` (deletions included),
    read with batched direct gets from the start of the stream to its end."""
    stream, key_prefix = f"KV_{bucket}", f"$KV.{bucket}."
    if "*" not in keys and ">" not in keys:
        return await _last(nc, stream, key_prefix, keys)
    inbox = nc.new_inbox()
    queue: asyncio.Queue[_NatsMsg] = asyncio.Queue()

    async def put(msg: _NatsMsg) -> None:
        queue.put_nowait(msg)

    sub = await nc.subscribe(inbox, cb=put)
    latest: dict[str, KVEntry] = {}
    start = 0
    try:
        while True:
            request = {"seq": start, "next_by_subj": key_prefix + keys, "batch": _SCAN_BATCH}
            await nc.publish(
                f"$JS.API.DIRECT.GET.{stream}", json.dumps(request).encode(), reply=inbox
            )
            while True:
                async with asyncio.timeout(_SCAN_TIMEOUT):  # (not wait_for: see reach.tasks)
                    msg = await queue.get()
                status = (msg.headers or {}).get("Status")
                if status == "404":  # nothing (more) matches
                    return latest
                if status == "204":  # end of this batch
                    break
                if status:
                    description = (msg.headers or {}).get("Description", "")
                    raise ScanError(f"direct get on {stream}: {status} {description}".strip())
                entry = _entry(msg, key_prefix)
                if entry is not None:
                    latest[entry.key] = entry
                    start = entry.revision + 1
            if int((msg.headers or {}).get("Nats-Num-Pending", "0") or 0) == 0:
                return latest
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def _last(nc: _NatsClient, stream: str, key_prefix: str, key: str) -> dict[str, KVEntry]:
    """One key's newest entry, by a direct get that names it in its subject (what a reader
    allowed only some keys may send)."""
    msg = await nc.request(f"$JS.API.DIRECT.GET.{stream}.{key_prefix}{key}", b"", _SCAN_TIMEOUT)
    status = (msg.headers or {}).get("Status")
    if status == "404":
        return {}
    if status:
        description = (msg.headers or {}).get("Description", "")
        raise ScanError(f"direct get on {stream}: {status} {description}".strip())
    entry = _entry(msg, key_prefix)
    return {entry.key: entry} if entry is not None else {}


async def follow(
    nc: _NatsClient, bucket: str, keys: str, reconnected: asyncio.Event
) -> AsyncIterator[KVEntry | None]:
    """Every current entry of ``keys`` (deletions left out), then ``None`` once caught up,
    then every change (deletions flagged). ``reconnected`` is set by the caller's
    connection after each reconnect: the bucket is scanned again and what changed in
    between is yielded."""
    key_prefix = f"$KV.{bucket}."
    changes: asyncio.Queue[_NatsMsg] = asyncio.Queue()

    async def put(msg: _NatsMsg) -> None:
        changes.put_nowait(msg)

    sub = await nc.subscribe(f"{republish_prefix(bucket)}.{keys}", cb=put)
    #: revision of every live key yielded so far
    held: dict[str, int] = {}
    try:
        first = True
        while True:
            reconnected.clear()
            for entry in _differences(held, await scan(nc, bucket, keys)):
                yield entry
            if first:
                first = False
                yield None
            while not reconnected.is_set():
                msg = await _next(changes, reconnected)
                if msg is None:
                    break
                change = _entry(msg, key_prefix)
                if change is None or change.revision <= held.get(change.key, 0):
                    continue
                if change.deleted:
                    if held.pop(change.key, None) is None:
                        continue
                else:
                    held[change.key] = change.revision
                yield change
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


def _differences(held: dict[str, int], now: dict[str, KVEntry]) -> list[KVEntry]:
    """What turns ``held`` into ``now`` (and updates ``held``): newer entries, and a
    deletion for every held key that is gone or deleted."""
    out: list[KVEntry] = []
    for key, entry in now.items():
        if entry.deleted:
            continue
        if entry.revision > held.get(key, 0):
            held[key] = entry.revision
            out.append(entry)
    for key in [k for k in held if k not in now or now[k].deleted]:
        gone = now.get(key)
        out.append(KVEntry(key, b"", gone.revision if gone else held[key], deleted=True))
        del held[key]
    return out


async def _next(changes: asyncio.Queue[_NatsMsg], reconnected: asyncio.Event) -> Any:
    """The next change, or None when ``reconnected`` is set first."""
    if not changes.empty():
        return changes.get_nowait()
    getting = asyncio.ensure_future(changes.get())
    waiting = asyncio.ensure_future(reconnected.wait())
    try:
        await asyncio.wait({getting, waiting}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
        if not getting.done():
            getting.cancel()
    if getting.done() and not getting.cancelled():
        return getting.result()
    return None
