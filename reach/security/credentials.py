"""Client credentials: the REACH_CREDENTIALS store, authentication, credentials files.

A client (an agent, a caller, the registrar, an operator) holds a client id and a
random secret. The store keeps only a verifier of the secret (see ``verifiers``), so
reading the KV bucket does not reveal secrets. ``CredentialStore.authenticate`` says the
same thing for an unknown client and a wrong secret (no enumeration of client ids) and
does the same work for both. The right secret always gets in (unless revoked): wrong
guesses at a 256-bit secret cost the guesser, not its owner, so none is rate limited.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import stat
import tempfile
from collections import Counter
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Final, Protocol, cast

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from reach.clock import Clock, system_clock
from reach.errors import AuthenticationFailed, CodecError, ConfigurationError, ReachError
from reach.security.claims import (
    KNOWN_ROLES,
    ROLE_ADMIN,
    ROLE_GATEWAY,
    ROLE_JOBS,
    ROLE_REGISTRAR,
)
from reach.security.verifiers import dummy_verifier, hash_secret, new_secret, verify_secret
from reach.transport import Connection, KVBucket, KVConflict, KVEntry
from reach.wire import subjects
from reach.wire.modelcodec import decode_record, encode_model
from reach.wire.models import SubjectToken, format_validation_error

__all__ = [
    "KNOWN_ROLES",
    "ROLE_ADMIN",
    "ROLE_GATEWAY",
    "ROLE_JOBS",
    "ROLE_REGISTRAR",
    "ClientRecord",
    "CredentialStore",
    "CredentialsFile",
    "CredentialsRejected",
    "RecordCache",
    "hash_secret",
    "new_secret",
    "read_private_file",
    "verify_secret",
    "write_private_file",
]

log = logging.getLogger("reach.security")


_CLIENT_ID_RE: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CLIENT_KEY_PREFIX: Final = "client."
_GENERIC_REFUSAL: Final = "invalid client id or secret"


# -- records -----------------------------------------------------------------------------


def _client_id(value: str) -> str:
    if not _CLIENT_ID_RE.fullmatch(value):
        raise PydanticCustomError(
            "client_id",
            "must be 1-64 letters, digits, '_' or '-', got {value}",
            {"value": repr(value)},
        )
    return value


ClientId = Annotated[str, AfterValidator(_client_id)]


class ClientRecord(BaseModel):
    """One client in REACH_CREDENTIALS (key ``client.<client_id>``); never holds the secret."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    client_id: ClientId
    level: int = Field(ge=1, le=4, description="clearance: may call capabilities up to this level")
    agent_id: SubjectToken | None = Field(None, description="the agent this client may act as")
    roles: tuple[str, ...] = Field(default=(), description="admin, registrar")
    capabilities: tuple[SubjectToken, ...] = Field(
        default=(),
        description="capabilities the bound agent may serve on their queue subjects",
    )
    secret_hash: str
    created_at: float
    revoked_at: float | None = None

    @field_validator("roles")
    @classmethod
    def _known_roles(cls, roles: tuple[str, ...]) -> tuple[str, ...]:
        unknown = sorted(set(roles) - KNOWN_ROLES)
        if unknown:
            raise PydanticCustomError(
                "unknown_role",
                "unknown role(s) {roles}; known: {known}",
                {"roles": ", ".join(unknown), "known": ", ".join(sorted(KNOWN_ROLES))},
            )
        return tuple(sorted(set(roles)))

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    def has_role(self, role: str) -> bool:
        return role in self.roles


def _decode_record(data: bytes) -> ClientRecord:
    return decode_record(ClientRecord, data, "credential")


# -- errors ------------------------------------------------------------------------------


class CredentialsRejected(AuthenticationFailed):
    """A client id + secret was refused; ``reason`` is for logs, the message for the client.

    Reasons: ``unknown_client`` and ``bad_secret`` (same message), ``revoked`` (said only
    to a client that knows the secret), ``unconfirmed`` (an id not in memory that the
    bucket could not confirm in time).
    """

    def __init__(self, message: str, *, reason: str, client_id: str = "") -> None:
        self.reason = reason
        self.client_id = client_id
        super().__init__(message)


# -- the store ---------------------------------------------------------------------------


class RecordCache(Protocol):
    """Records held in memory (``credcache.CredentialCache``): logins read them there."""

    @property
    def ready(self) -> bool:
        """Whether the records are caught up with the bucket (else the bucket is read)."""
        ...

    def get(self, client_id: str) -> ClientRecord | None:
        """The record held for ``client_id``, or None."""
        ...

    def may_read_miss(self) -> bool:
        """Whether a miss may still be confirmed in the bucket (a record added an instant
        ago); False once a budget of such reads is spent, so a flood of unknown ids is
        answered from memory alone."""
        ...


class CredentialStore:
    """Typed access to REACH_CREDENTIALS plus authentication.

    ``cache``: when set and ready, ``authenticate`` reads records from it instead of the
    bucket. ``refusals`` counts refused authentications by reason (for metrics).
    """

    def __init__(
        self,
        bucket: KVBucket,
        *,
        clock: Clock = system_clock,
        cache: RecordCache | None = None,
    ) -> None:
        self.bucket = bucket
        self._clock = clock
        self.cache = cache
        self.refusals: Counter[str] = Counter()

    @classmethod
    async def open(
        cls,
        conn: Connection,
        *,
        create: bool = True,
        replicas: int = 1,
        clock: Clock = system_clock,
    ) -> CredentialStore:
        bucket = await conn.key_value(subjects.CREDENTIALS_BUCKET, create=create, replicas=replicas)
        return cls(bucket, clock=clock)

    @staticmethod
    def _key(client_id: str) -> str:
        return _CLIENT_KEY_PREFIX + client_id

    async def add(
        self,
        client_id: str,
        level: int,
        agent_id: str | None = None,
        roles: Iterable[str] = (),
        capabilities: Iterable[str] = (),
    ) -> tuple[ClientRecord, str]:
        """Create a client; returns its record and its secret (shown this once only)."""
        if client_id == subjects.ANONYMOUS:
            # the writer token of an open fabric's audit events: a client of that name
            # could write events readers take for an open fabric's
            raise ConfigurationError(f"client id {client_id!r} is reserved")
        secret = new_secret()  # never one chosen by a person: see verifiers
        try:
            record = ClientRecord(
                client_id=client_id,
                level=level,
                agent_id=agent_id,
                roles=tuple(roles),
                capabilities=tuple(capabilities),
                secret_hash=hash_secret(secret),
                created_at=self._clock.time(),
            )
        except ValidationError as exc:
            raise ConfigurationError(
                f"invalid client {client_id!r}", format_validation_error(exc)
            ) from None
        try:
            await self.bucket.create(self._key(client_id), encode_model(record))
        except KVConflict:
            raise ConfigurationError(f"client {client_id} exists") from None
        return record, secret

    async def get(self, client_id: str) -> ClientRecord | None:
        """The record (revoked ones included), or None if there is no such client."""
        if not _CLIENT_ID_RE.fullmatch(client_id):
            return None
        entry = await self.bucket.get(self._key(client_id))
        if entry is None or not entry.value:
            return None
        return _decode_record(entry.value)

    async def list(self) -> list[ClientRecord]:
        """Every client, sorted by id; unreadable records are skipped (and logged)."""
        records: list[ClientRecord] = []
        # KVBucket.watch is an async generator: aclosing stops the watcher when we break
        watch = cast(
            AsyncGenerator[KVEntry | None, None], self.bucket.watch(_CLIENT_KEY_PREFIX + "*")
        )
        async with contextlib.aclosing(watch) as entries:
            async for entry in entries:
                if entry is None:
                    break
                if entry.deleted or not entry.value:
                    continue
                try:
                    records.append(_decode_record(entry.value))
                except CodecError as exc:
                    log.warning("skipping credential record %s: %s", entry.key, exc)
        return sorted(records, key=lambda r: r.client_id)

    async def revoke(self, client_id: str) -> ClientRecord:
        """Mark the client revoked (idempotent); ConfigurationError if it does not exist."""
        key = self._key(client_id)
        for _ in range(10):
            entry = await self.bucket.get(key) if _CLIENT_ID_RE.fullmatch(client_id) else None
            if entry is None or not entry.value:
                raise ConfigurationError(f"no client {client_id}")
            record = _decode_record(entry.value)
            if record.revoked:
                return record
            revoked = record.model_copy(update={"revoked_at": self._clock.time()})
            try:
                await self.bucket.update(key, encode_model(revoked), entry.revision)
            except KVConflict:
                continue
            return revoked
        raise ConfigurationError(f"client {client_id} keeps changing; revoke again")

    async def _lookup(self, client_id: str, read_timeout: float | None) -> ClientRecord | None:
        if not _CLIENT_ID_RE.fullmatch(client_id):
            return None
        cache = self.cache
        if cache is not None and cache.ready:
            record = cache.get(client_id)
            if record is not None or not cache.may_read_miss():
                return record
        if read_timeout is None:
            return await self.get(client_id)
        try:
            return await asyncio.wait_for(self.get(client_id), read_timeout)
        except (TimeoutError, ReachError) as exc:
            # the bucket cannot answer now (its stream electing a leader, the connection
            # away): refused, since waiting longer outlasts the login it would answer
            log.debug("credential %s not read within %.1fs: %s", client_id, read_timeout, exc)
            raise self._refuse(client_id, "unconfirmed") from None

    def _refuse(self, client_id: str, reason: str) -> CredentialsRejected:
        self.refusals[reason] += 1
        # bounded key: an attacker's strings are neither kept nor echoed at length
        shown = client_id if _CLIENT_ID_RE.fullmatch(client_id) else "<invalid>"
        # "revoked" is said only to who knows the secret
        revoked = reason == "revoked"
        message = f"client {shown} is revoked" if revoked else _GENERIC_REFUSAL
        return CredentialsRejected(message, reason=reason, client_id=shown)

    async def authenticate(
        self, client_id: str, secret: str, *, read_timeout: float | None = None
    ) -> ClientRecord:
        """The client's record if the secret is right; CredentialsRejected otherwise.

        The right secret always gets in, however many wrong ones were tried.
        ``read_timeout``: a record not in the cache is read from the bucket within this
        many seconds, else refused with reason ``unconfirmed`` (None: wait as long as the
        bucket takes)."""
        record = await self._lookup(client_id, read_timeout)
        if record is None:
            verify_secret(secret, dummy_verifier())  # the work a wrong secret costs
            raise self._refuse(client_id, "unknown_client")
        if not verify_secret(secret, record.secret_hash):
            raise self._refuse(client_id, "bad_secret")
        if record.revoked:
            raise self._refuse(client_id, "revoked")
        return record


# -- private files -----------------------------------------------------------------------


def write_private_file(path: str | Path, data: bytes) -> None:
    """Write ``data`` atomically to a file only the owner can read (mode 0600)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # mkstemp creates the file with mode 0600, so the secret is never readable by others
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_private_file(path: str | Path, what: str) -> bytes:
    """Read a file holding a secret: error if others may write it, a warning if they may read it."""
    source = Path(path)
    try:
        st = source.stat()
        data = source.read_bytes()
    except FileNotFoundError:
        raise ConfigurationError(f"{what} {source} not found") from None
    except OSError as exc:
        raise ConfigurationError(f"cannot read {what} {source}: {exc.strerror or exc}") from None
    if os.name == "posix":
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o022:
            raise ConfigurationError(
                f"{what} {source} is writable by group or others (mode {mode:04o});"
                f" run: chmod 600 {source}"
            )
        if mode & 0o044:
            log.warning(
                "%s %s is readable by group or others (mode %04o); run: chmod 600 %s",
                what,
                source,
                mode,
                source,
            )
    return data


@dataclass(frozen=True, slots=True)
class CredentialsFile:
    """What a client needs to connect: ``{"url": ..., "client_id": ..., "secret": ...}``."""

    url: str
    client_id: str
    secret: str

    _FIELDS: ClassVar[tuple[str, ...]] = ("url", "client_id", "secret")

    def write(self, path: str | Path) -> None:
        """Write atomically with mode 0600."""
        body = {"url": self.url, "client_id": self.client_id, "secret": self.secret}
        write_private_file(path, (json.dumps(body, indent=2) + "\n").encode("utf-8"))

    @classmethod
    def read(cls, path: str | Path) -> CredentialsFile:
        """Read and check a credentials file; ConfigurationError naming the file otherwise."""
        data = read_private_file(path, "credentials file")
        try:
            body: Any = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ConfigurationError(f"credentials file {path} is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ConfigurationError(f"credentials file {path} must hold a JSON object")
        problems = [
            f"{name}: missing or not a non-empty string"
            for name in cls._FIELDS
            if not isinstance(body.get(name), str) or not body[name]
        ]
        if not problems and not _CLIENT_ID_RE.fullmatch(body["client_id"]):
            problems.append("client_id: must be 1-64 letters, digits, '_' or '-'")
        if problems:
            raise ConfigurationError(f"invalid credentials file {path}", problems)
        return cls(url=body["url"], client_id=body["client_id"], secret=body["secret"])
