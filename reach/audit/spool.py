"""Audit batches kept on local disk until REACH_AUDIT acknowledges them.

An audit writer holds what the stream has not acked in memory first; past its bound,
and at shutdown, the oldest sealed batches go to a spool file here. Nothing is written
while the stream acks normally.

Layout: ``<root>/<fabric>/<writer>/<writer id>.spool``. ``<fabric>`` names the servers
the writer was given (``fabric_key``), ``<writer>`` is the NATS user the batches are
published under (only a connection logged in as that user may send them, so any later
writer of that user on that fabric takes them over). Each live writer locks its own file
(``flock``); a writer starting up takes over every file of its directory that no live
process locks, sends them oldest first with their original message ids (the stream
stores a resent batch once within its duplicate window) and deletes each file once
everything in it is acked.

A file is a header (``MAGIC``) and records: a fixed header (tag, payload length,
payload CRC-32, events) and the payload, msgpack ``[capability, msg_id, calls, notable,
dropped, data]``. A record with no events and ``dropped`` > 0 carries a count of events
a writer had to drop and not yet reported to the alert rules. A torn last record (a
crash mid-write) is ignored; a damaged one is skipped and its events counted as lost.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import struct
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from reach.audit.batch import RowSummary

__all__ = ["Batch", "Spool", "SpoolSurvey", "fabric_key", "spool_directory", "survey"]

log = logging.getLogger("reach.audit")

MAGIC = b"REACH-AUDIT-SPOOL-1\n"
SUFFIX = ".spool"
_TAG = b"RSB1"
_HEAD = struct.Struct("<4sIII")  # tag, payload length, payload CRC-32, events
_NAME_RE = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(slots=True)
class Batch:
    """One stream message of audit events, sealed: written (and resent) as it is."""

    #: the last token of its subject
    capability: str
    msg_id: str
    data: bytes
    count: int
    summary: RowSummary


def fabric_key(servers: Sequence[str]) -> str:
    """A directory name for the fabric at ``servers`` (the same set in any order gives
    the same name): the first URL's host and port, readable, and a hash of them all."""
    urls = sorted({s.strip().lower().rstrip("/") for s in servers if s.strip()})
    if not urls:
        return "default"
    first = urls[0].split("://", 1)[-1].rsplit("@", 1)[-1]
    digest = hashlib.sha256("\n".join(urls).encode()).hexdigest()[:10]
    return f"{_NAME_RE.sub('_', first)[:64]}-{digest}"


def spool_directory(root: Path, servers: Sequence[str], writer: str) -> Path:
    """Where the writers of NATS user ``writer`` on the fabric at ``servers`` spool."""
    return root / fabric_key(servers) / _NAME_RE.sub("_", writer)


def _encode(batch: Batch, dropped: int = 0) -> bytes:
    summary = batch.summary
    fields = [batch.capability, batch.msg_id, summary.calls, summary.notable, dropped, batch.data]
    payload: bytes = msgpack.packb(fields, use_bin_type=True)
    return _HEAD.pack(_TAG, len(payload), zlib.crc32(payload), batch.count) + payload


def _decode(payload: bytes, count: int) -> tuple[Batch, int]:
    """A record's batch, and its drop count."""
    fields: Any = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    capability, msg_id, calls, notable, dropped, data = fields
    if not (
        isinstance(capability, str)
        and isinstance(msg_id, str)
        and isinstance(calls, dict)
        and all(isinstance(k, str) and isinstance(v, int) for k, v in calls.items())
        and isinstance(notable, int)
        and isinstance(dropped, int)
        and isinstance(data, bytes)
    ):
        raise ValueError("a spool record of the wrong shape")
    summary = RowSummary()
    summary.calls = calls
    summary.notable = notable
    return Batch(capability, msg_id, data, count, summary), dropped


class _File:
    """One spool file, open and locked: records from ``offset`` on are not yet acked."""

    __slots__ = ("events", "fd", "offset", "path", "records", "size")

    def __init__(self, path: Path, fd: int, size: int) -> None:
        self.path = path
        self.fd = fd
        self.size = size
        self.offset = len(MAGIC)
        #: records and events from ``offset`` on
        self.records = 0
        self.events = 0

    def scan(self) -> None:
        """Count the complete records (a torn tail is left out, and cut on the next read)."""
        offset = self.offset
        while offset + _HEAD.size <= self.size:
            tag, length, _, count = _HEAD.unpack(os.pread(self.fd, _HEAD.size, offset))
            if tag != _TAG or offset + _HEAD.size + length > self.size:
                break
            self.records += 1
            self.events += count
            offset += _HEAD.size + length
        self.size = offset

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _lock(path: Path, create: bool) -> _File | None:
    """``path`` opened and locked for this process; None when another live process holds
    it, or it is gone (another writer finished it), or it is not a spool file."""
    flags = os.O_RDWR | os.O_APPEND | (os.O_CREAT | os.O_EXCL if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # locked: still the file at that path (not one unlinked by its finisher)?
        if os.fstat(fd).st_ino != os.stat(path).st_ino:
            raise FileNotFoundError(path)
        if create:
            os.write(fd, MAGIC)
        elif os.pread(fd, len(MAGIC), 0) != MAGIC:
            log.warning("audit: %s is not a spool file: left alone", path)
            raise FileNotFoundError(path)
        return _File(path, fd, os.fstat(fd).st_size)
    except (BlockingIOError, FileNotFoundError):
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise


class Spool:
    """The spool of one writer: the files it took over, then its own (made on the first
    ``append``). ``peek`` gives the oldest unsent record, ``done`` says it was acked."""

    def __init__(self, directory: Path, name: str, max_bytes: int) -> None:
        self.directory = directory
        self._name = name
        self.max_bytes = max_bytes
        self._files: deque[_File] = deque()
        self._own: _File | None = None
        self._peeked: Batch | None = None
        #: unsent records and events in every file held
        self.records = 0
        self.events = 0
        #: events of damaged records, skipped (the writer counts them as dropped), and
        #: drops earlier writers recorded here and did not report (the writer reports them)
        self.lost = 0
        self.drops = 0
        #: the last append failed (said once until one succeeds)
        self._failing = False

    @classmethod
    def open(
        cls, root: Path, servers: Sequence[str], writer: str, name: str, max_bytes: int
    ) -> Spool:
        """The spool of writer ``name`` of NATS user ``writer`` on the fabric at ``servers``,
        with what earlier writers of that user left (see ``adopt``)."""
        spool = cls(spool_directory(root, servers, writer), name, max_bytes)
        taken = spool.adopt()
        if spool.records:
            log.info("audit: sending %d event(s) left in %s", taken, spool.directory)
        return spool

    @property
    def path(self) -> Path:
        """The file this writer appends to."""
        return self.directory / f"{self._name}{SUFFIX}"

    @property
    def own_bytes(self) -> int:
        return self._own.size if self._own is not None else 0

    def adopt(self) -> int:
        """Take over the files no live writer holds; the events in them."""
        try:
            paths = sorted(self.directory.glob(f"*{SUFFIX}"), key=_mtime)
        except OSError:
            return 0
        taken = 0
        for path in paths:
            if path == self.path:
                continue
            try:
                found = _lock(path, create=False)
                if found is None:
                    continue
                found.scan()
            except OSError as exc:
                log.warning("audit: spool file %s not read: %s", path, exc)
                continue
            if not found.records:
                self._finish(found)
                continue
            self._files.append(found)
            self.records += found.records
            self.events += found.events
            taken += found.events
        return taken

    def append_drops(self, dropped: int) -> bool:
        """Record ``dropped`` events not reported to the alert rules (past the limit too)."""
        return self.append(Batch("", "", b"", 0, RowSummary()), dropped=dropped)

    def append(self, batch: Batch, *, dropped: int = 0) -> bool:
        """Add ``batch`` at the end; False when the file would pass ``max_bytes`` (unless it
        is a drop count) or cannot be written."""
        record = _encode(batch, dropped)
        force = dropped > 0
        own = self._own
        if not force and (own.size if own is not None else len(MAGIC)) + len(record) > (
            self.max_bytes
        ):
            return False
        try:
            if own is None:
                self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
                own = _lock(self.path, create=True)
                if own is None:
                    raise FileExistsError(self.path)
                own.size = len(MAGIC)
                self._own = own
                self._files.append(own)
            if os.write(own.fd, record) != len(record):
                os.ftruncate(own.fd, own.size)  # a short write (disk full): undone
                raise OSError(f"{len(record)} bytes not written")
        except OSError as exc:
            if not self._failing:
                self._failing = True
                log.error("audit: cannot write to the spool %s: %s", self.path, exc)
            return False
        self._failing = False
        own.size += len(record)
        own.records += 1
        own.events += batch.count
        self.records += 1
        self.events += batch.count
        return True

    def peek(self) -> Batch | None:
        """The oldest batch not yet acked (the same one until ``done``); drop counts on
        the way are added to ``drops`` and passed."""
        while self._peeked is None and self._files:
            head = self._files[0]
            if not head.records:
                if head is self._own:
                    return None  # its next record is not written yet
                self._files.popleft()
                self._finish(head)
                continue
            self._peeked = self._read(head)
        return self._peeked

    def _read(self, file: _File) -> Batch | None:
        tag, length, crc, count = _HEAD.unpack(os.pread(file.fd, _HEAD.size, file.offset))
        payload = os.pread(file.fd, length, file.offset + _HEAD.size)
        batch: Batch | None = None
        dropped = 0
        if tag == _TAG and len(payload) == length and zlib.crc32(payload) == crc:
            try:
                batch, dropped = _decode(payload, count)
            except (ValueError, TypeError, msgpack.UnpackException) as exc:
                log.error("audit: a record of %s not understood: %s", file.path, exc)
        else:
            log.error("audit: a damaged record in %s: %d event(s) lost", file.path, count)
        if batch is None or not count:
            self.lost += count if batch is None else 0
            self.drops += dropped
            self._advance(file, length, count)
            return None
        return batch

    def done(self) -> None:
        """The record ``peek`` gave was acked (or refused for good): past it."""
        batch, self._peeked = self._peeked, None
        if batch is None or not self._files:
            return
        head = self._files[0]
        length = _HEAD.unpack(os.pread(head.fd, _HEAD.size, head.offset))[1]
        self._advance(head, length, batch.count)

    def _advance(self, file: _File, length: int, count: int) -> None:
        file.offset += _HEAD.size + length
        file.records -= 1
        file.events -= count
        self.records -= 1
        self.events -= count
        if not file.records:
            self._files.remove(file)
            if file is self._own:
                self._own = None
            self._finish(file)

    def _finish(self, file: _File) -> None:
        """Every record of ``file`` is acked: it goes (unlinked while still locked)."""
        with contextlib.suppress(OSError):
            file.path.unlink()
        file.close()

    def close(self) -> None:
        """Keep what is unsent on disk for the next writer; release every file."""
        if self._own is not None:
            with contextlib.suppress(OSError):
                os.fsync(self._own.fd)
        for file in self._files:
            file.close()
        self._files.clear()
        self._own = None
        self._peeked = None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


@dataclass(frozen=True, slots=True)
class SpoolSurvey:
    """What one spool directory holds (``reach doctor``)."""

    directory: Path
    files: int
    events: int
    bytes: int
    #: events dropped and recorded there, not yet reported to the alert rules
    dropped: int
    #: files a live writer holds (it is sending or filling them)
    live: int


def survey(root: Path, servers: Sequence[str] | None = None) -> list[SpoolSurvey]:
    """Every spool directory under ``root`` with a file in it (read only, no locks kept):
    of the fabric at ``servers`` only, if given (the spool root is per user, shared by
    every fabric the user's programs write to)."""
    found: list[SpoolSurvey] = []
    fabric = "*" if servers is None else fabric_key(servers)
    try:
        directories = sorted({p.parent for p in root.glob(f"{fabric}/*/*{SUFFIX}")})
    except OSError:
        return found
    for directory in directories:
        files = events = size = dropped = live = 0
        for path in directory.glob(f"*{SUFFIX}"):
            try:
                info = _peek_file(path)
            except OSError:
                continue
            files += 1
            live += info[3]
            events += info[0]
            dropped += info[1]
            size += info[2]
        if files:
            found.append(SpoolSurvey(directory, files, events, size, dropped, live))
    return found


def _peek_file(path: Path) -> tuple[int, int, int, int]:
    """Events, drop counts, bytes of one file, and 1 if a live writer holds it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            live = 0
        except BlockingIOError:
            live = 1
        file = _File(path, fd, os.fstat(fd).st_size)
        size = file.size
        file.scan()
        dropped = 0
        offset = len(MAGIC)
        while offset < file.size:
            _, length, _, count = _HEAD.unpack(os.pread(fd, _HEAD.size, offset))
            if count == 0:  # a drop count: the only records without events
                with contextlib.suppress(ValueError, TypeError, msgpack.UnpackException):
                    dropped += _decode(os.pread(fd, length, offset + _HEAD.size), 0)[1]
            offset += _HEAD.size + length
        return file.events, dropped, size, live
    finally:
        os.close(fd)
