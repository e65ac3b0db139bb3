"""Recent replies of a callee, by call id or idempotency key: a repeated call (a retry
whose first reply was lost, a second call with the same idempotency key) is answered
with the first reply, and one that arrives while the first still runs waits for it."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

__all__ = ["ReplyCache"]


class ReplyCache:
    """Recent replies by call id / idempotency key, and the calls still running.

    Bounded by entry count and by total reply bytes; entries expire after ``ttl_sec``.
    A future for a running call is only created when a repeat actually waits on it.
    """

    def __init__(
        self, max_entries: int = 10_000, ttl_sec: float = 300.0, max_bytes: int = 64 << 20
    ) -> None:
        self._done: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._running: dict[str, asyncio.Future[bytes] | None] = {}
        self._max = max_entries
        self._max_bytes = max_bytes
        self._bytes = 0
        self._ttl = ttl_sec

    def get(self, key: str, now: float) -> bytes | asyncio.Future[bytes] | None:
        hit = self._done.get(key)
        if hit is not None:
            if now - hit[0] <= self._ttl:
                return hit[1]
            del self._done[key]
            self._bytes -= len(hit[1])
        if key not in self._running:
            return None
        future = self._running[key]
        if future is None:
            future = self._running[key] = asyncio.get_running_loop().create_future()
        return future

    def start(self, key: str) -> None:
        self._running[key] = None

    def finish(self, key: str, reply: bytes, now: float, *, remember: bool = True) -> None:
        future = self._running.pop(key, None)
        if future is not None and not future.done():
            future.set_result(reply)
        if remember:
            old = self._done.pop(key, None)
            if old is not None:
                self._bytes -= len(old[1])
            self._done[key] = (now, reply)
            self._bytes += len(reply)
            while self._done and (len(self._done) > self._max or self._bytes > self._max_bytes):
                _, (_, evicted) = self._done.popitem(last=False)
                self._bytes -= len(evicted)
