"""The credential records in memory, kept equal to REACH_CREDENTIALS by a KV watch.

Logins are answered from here (``CredentialStore.cache``): no bucket round trip per
login, so a flood of made-up client ids costs a dict miss each, and a revocation is seen
as soon as the watch delivers it. Until the watch has caught up the first time
(``ready``) the store reads the bucket instead.

Memory: one record per credential in the bucket (written only by admins), nothing per
login attempt.

Once caught up, the records stay in memory for good: when the watch fails (its
connection away, a leader election of the bucket's stream) logins are still answered
from them while the watch is set up again, so a failover never makes a login wait on
the bucket. The next watch's initial values bring back what changed meanwhile.

Other code learns of changes with ``on_change``: ``callback(client_id, record)`` runs
for every record applied (the initial load included), ``record`` None when the key was
deleted and ``record.revoked`` set after a revocation. A callback must be quick and not
raise (an exception is logged and ignored); to do slow work, start a task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Final

from reach.clock import Clock, system_clock
from reach.errors import CodecError, ReachError
from reach.security.credentials import ClientRecord
from reach.tasks import cancel_and_wait
from reach.transport import KVBucket, KVEntry
from reach.wire.modelcodec import decode_record

__all__ = ["ChangeCallback", "CredentialCache"]

log = logging.getLogger("reach.security")

ChangeCallback = Callable[[str, ClientRecord | None], None]

_PREFIX: Final = "client."
#: seconds between attempts to watch again after the watch failed
_RETRY_SEC: Final = 1.0


class CredentialCache:
    """``client_id -> ClientRecord`` from a watch of ``client.*`` in REACH_CREDENTIALS.

    ``miss_reads_per_sec``: how many misses per second may still be confirmed in the
    bucket (a client added an instant ago, not yet delivered by the watch); beyond that
    budget a miss is answered from memory alone.
    """

    def __init__(
        self,
        bucket: KVBucket,
        *,
        miss_reads_per_sec: float = 20.0,
        clock: Clock = system_clock,
    ) -> None:
        if miss_reads_per_sec <= 0:
            raise ValueError("miss_reads_per_sec must be positive")
        self._bucket = bucket
        self._clock = clock
        self._records: dict[str, ClientRecord] = {}
        self._callbacks: list[ChangeCallback] = []
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: confirmations in the bucket of records a new watch did not deliver
        self._checks: set[asyncio.Task[None]] = set()
        self._rate = miss_reads_per_sec
        self._tokens = miss_reads_per_sec
        self._refilled = clock.monotonic()
        self._following = False

    def __len__(self) -> int:
        return len(self._records)

    @property
    def ready(self) -> bool:
        """Whether the records were loaded: from then on logins are answered from them."""
        return self._ready.is_set()

    @property
    def following(self) -> bool:
        """Whether the watch is caught up now (False while it is set up again)."""
        return self._following

    def get(self, client_id: str) -> ClientRecord | None:
        return self._records.get(client_id)

    def may_read_miss(self) -> bool:
        # a token bucket: refilled at the rate, holding at most one second's worth
        now = self._clock.monotonic()
        self._tokens = min(self._rate, self._tokens + (now - self._refilled) * self._rate)
        self._refilled = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def on_change(self, callback: ChangeCallback) -> Callable[[], None]:
        """Call ``callback(client_id, record or None)`` on every change; returns a
        function that stops the calls."""
        self._callbacks.append(callback)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._callbacks.remove(callback)

        return remove

    async def start(self, timeout: float = 10.0) -> None:
        """Start watching; returns once caught up, or after ``timeout`` (the store reads
        the bucket until the watch catches up)."""
        if self._task is None:
            self._task = asyncio.create_task(self._follow())
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except TimeoutError:
            log.warning("credential cache not caught up after %.0fs: reading the bucket", timeout)

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
        if self._checks:
            await cancel_and_wait(list(self._checks))
        self._ready.clear()
        self._following = False

    async def _follow(self) -> None:
        failures = 0
        while True:
            try:
                await self._watch()
                problem = "ended"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the bucket away, a reconnect: watch again
                problem = f"failed ({exc or type(exc).__name__})"
            if self._following or not failures:  # once per outage, not per attempt
                log.warning(
                    "credential watch %s; answering logins from the %d record(s) in memory"
                    " while watching again",
                    problem,
                    len(self._records),
                )
            self._following = False
            failures += 1
            await asyncio.sleep(_RETRY_SEC)

    async def _watch(self) -> None:
        loaded: set[str] = set()  # ids seen in this watch's initial values
        caught_up = False
        async for entry in self._bucket.watch(_PREFIX + "*"):
            if entry is None:
                if caught_up:
                    continue
                # caught up: ids no longer in the bucket (deleted while not watching) go,
                # once the bucket confirms it: a watch set up during a failover can call
                # itself caught up before every record has come, and a record dropped
                # wrongly here would refuse its client's logins
                missing = [c for c in self._records if c not in loaded]
                if missing:
                    self._checks.add(asyncio.create_task(self._drop_if_gone(missing)))
                caught_up = True
                if self._ready.is_set() and not self._following:
                    log.info("credential watch caught up again (%d records)", len(self._records))
                self._following = True
                self._ready.set()
                continue
            client_id = entry.key.removeprefix(_PREFIX)
            if not caught_up:
                loaded.add(client_id)
            record = self._decode(entry)
            why = "" if record else f"deleted or unreadable at revision {entry.revision}"
            self._apply(client_id, record, why)

    async def _drop_if_gone(self, client_ids: list[str]) -> None:
        """Forget each of ``client_ids`` whose key the bucket says is gone (deleted); keep
        those it still holds (their watch delivers them) or cannot say of now."""
        try:
            for client_id in client_ids:
                try:
                    entry = await self._bucket.get(_PREFIX + client_id)
                except ReachError as exc:
                    log.info("credential %s kept: the bucket cannot say now (%s)", client_id, exc)
                    continue
                gone = entry is None or entry.deleted or not entry.value
                if gone and client_id in self._records:
                    self._apply(client_id, None, "the bucket confirms it is gone")
        finally:
            task = asyncio.current_task()
            if task is not None:
                self._checks.discard(task)

    @staticmethod
    def _decode(entry: KVEntry) -> ClientRecord | None:
        if entry.deleted or not entry.value:
            return None
        try:
            return decode_record(ClientRecord, entry.value, "credential")
        except CodecError as exc:  # an unreadable record lets nobody in
            log.warning("credential record %s unreadable: %s", entry.key, exc)
            return None

    def _apply(self, client_id: str, record: ClientRecord | None, why: str) -> None:
        if record is not None and record.client_id != client_id:
            record = None  # a record filed under another id's key is not that id's record
        if record is None:
            if self._records.pop(client_id, None) is None:
                return
            log.info("credential %s forgotten (%s): its logins are refused", client_id, why)
        else:
            self._records[client_id] = record
        for callback in list(self._callbacks):
            try:
                callback(client_id, record)
            except Exception:
                log.exception("credential change callback failed for %s", client_id)
