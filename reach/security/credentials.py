"""Client credentials: slow secret hashes, the REACH_CREDENTIALS store, credentials files.

A client (an agent, a caller, the registrar, an operator) holds a client id and a
random secret. The store keeps only an scrypt hash of the secret, so reading the KV
bucket does not reveal secrets. ``CredentialStore.authenticate`` says the same thing
for an unknown client and a wrong secret (no enumeration of client ids), does the same
work for both (no timing oracle), and slows down a client id that keeps failing.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import functools
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import stat
import tempfile
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Final, cast

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from reach import subjects
from reach.clock import Clock, system_clock
from reach.errors import AuthenticationFailed, CodecError, ConfigurationError
from reach.messages import decode_record, encode_model
from reach.models import SubjectToken, format_validation_error
from reach.security.ratelimit import FailureLimiter
from reach.transport import Connection, KVBucket, KVConflict, KVEntry

__all__ = [
    "KNOWN_ROLES",
    "ROLE_ADMIN",
    "ROLE_JOBS",
    "ROLE_REGISTRAR",
    "ClientRecord",
    "CredentialStore",
    "CredentialsFile",
    "CredentialsRejected",
    "TooManyAttempts",
    "hash_secret",
    "new_secret",
    "read_private_file",
    "verify_secret",
    "write_private_file",
]

log = logging.getLogger("reach.security")

#: may manage credentials and keys
ROLE_ADMIN: Final = "admin"
#: the registrar / token issuer service
ROLE_REGISTRAR: Final = "registrar"
#: may use REACH_JOBS: an async-mode agent (writes its jobs' records) or a caller that
#: waits for jobs. KV permissions cannot be narrowed to one job, so a holder may read
#: (and an agent overwrite) every job record: given only to who needs it
ROLE_JOBS: Final = "jobs"
KNOWN_ROLES: Final = frozenset({ROLE_ADMIN, ROLE_REGISTRAR, ROLE_JOBS})

# scrypt n=2**14, r=8, p=1: ~40 ms per hash on the development machine (measured), 16 MiB
_SCRYPT_N: Final = 2**14
_SCRYPT_R: Final = 8
_SCRYPT_P: Final = 1
_SALT_BYTES: Final = 16
_HASH_BYTES: Final = 32
# bounds on parameters read back from a stored hash, so a crafted record cannot pin a CPU
_MAX_N: Final = 2**20
_MAX_R: Final = 32
_MAX_P: Final = 16
_MAX_SECRET_CHARS: Final = 1024

_CLIENT_ID_RE: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CLIENT_KEY_PREFIX: Final = "client."
_GENERIC_REFUSAL: Final = "invalid client id or secret"


# -- secrets and hashes ------------------------------------------------------------------


def new_secret() -> str:
    """A fresh random secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _scrypt(secret: str, salt: bytes, n: int, r: int, p: int, dklen: int) -> bytes:
    return hashlib.scrypt(
        secret.encode("utf-8"),
        salt=salt,
        n=n,
        r=r,
        p=p,
        dklen=dklen,
        maxmem=128 * n * r * p + 1024 * 1024,
    )


def hash_secret(secret: str) -> str:
    """Hash a secret for storage: ``scrypt$<n>$<r>$<p>$<salt b64>$<hash b64>``."""
    if not secret:
        raise ConfigurationError("a secret must not be empty")
    salt = secrets.token_bytes(_SALT_BYTES)
    try:
        digest = _scrypt(secret, salt, _SCRYPT_N, _SCRYPT_R, _SCRYPT_P, _HASH_BYTES)
    except UnicodeEncodeError:
        raise ConfigurationError("a secret must be valid Unicode text") from None
    return f"scrypt${_SCRYPT_N}${_SCRYPT_R}${_SCRYPT_P}${_b64(salt)}${_b64(digest)}"


def verify_secret(secret: str, encoded: str) -> bool:
    """Whether ``secret`` matches ``encoded``; False (never an error) for a malformed hash."""
    if not isinstance(secret, str) or not isinstance(encoded, str):
        return False
    if not secret or len(secret) > _MAX_SECRET_CHARS:
        return False
    parts = encoded.split("$")
    if len(parts) != 6 or parts[0] != "scrypt":
        return False
    try:
        n, r, p = (int(x) for x in parts[1:4])
        salt = base64.b64decode(parts[4], validate=True)
        expected = base64.b64decode(parts[5], validate=True)
    except (ValueError, binascii.Error):
        return False
    if not (1 < n <= _MAX_N and n & (n - 1) == 0 and 1 <= r <= _MAX_R and 1 <= p <= _MAX_P):
        return False
    if not salt or not 16 <= len(expected) <= 64:
        return False
    try:
        actual = _scrypt(secret, salt, n, r, p, len(expected))
    except (ValueError, MemoryError):  # UnicodeEncodeError (lone surrogates) is a ValueError
        return False
    return hmac.compare_digest(actual, expected)


@functools.cache
def _dummy_hash() -> str:
    # verified against for unknown client ids, so they cost as much as a wrong secret
    return hash_secret(new_secret())


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
    to a client that knows the secret), ``rate_limited`` (see ``TooManyAttempts``).
    """

    def __init__(self, message: str, *, reason: str, client_id: str = "") -> None:
        self.reason = reason
        self.client_id = client_id
        super().__init__(message)


class TooManyAttempts(CredentialsRejected):
    """Too many wrong secrets for this client id; ``retry_after`` seconds to wait."""

    def __init__(self, client_id: str, retry_after: float) -> None:
        self.retry_after = retry_after
        super().__init__(
            f"too many failed attempts for client {client_id}; retry in {retry_after:.0f}s",
            reason="rate_limited",
            client_id=client_id,
        )


# -- the store ---------------------------------------------------------------------------


class CredentialStore:
    """Typed access to REACH_CREDENTIALS plus authentication with rate limiting."""

    def __init__(
        self,
        bucket: KVBucket,
        *,
        clock: Clock = system_clock,
        limiter: FailureLimiter | None = None,
    ) -> None:
        self.bucket = bucket
        self._clock = clock
        self.limiter = limiter if limiter is not None else FailureLimiter(clock=clock)
        #: per client id: the check of a secret under way, and how many wait for it. One
        #: at a time per id, so guesses sent in parallel meet the failure limit too (all
        #: of them would otherwise pass its check before the first wrong one counts)
        self._checking: dict[str, tuple[asyncio.Lock, list[int]]] = {}

    @classmethod
    async def open(
        cls,
        conn: Connection,
        *,
        create: bool = True,
        replicas: int = 1,
        clock: Clock = system_clock,
        limiter: FailureLimiter | None = None,
    ) -> CredentialStore:
        bucket = await conn.key_value(subjects.CREDENTIALS_BUCKET, create=create, replicas=replicas)
        return cls(bucket, clock=clock, limiter=limiter)

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
        secret = new_secret()
        try:
            record = ClientRecord(
                client_id=client_id,
                level=level,
                agent_id=agent_id,
                roles=tuple(roles),
                capabilities=tuple(capabilities),
                secret_hash=await asyncio.to_thread(hash_secret, secret),
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

    async def authenticate(self, client_id: str, secret: str) -> ClientRecord:
        """The client's record if the secret is right; CredentialsRejected otherwise."""
        # bounded key: an attacker cannot fill the limiter with huge strings
        limit_key = client_id if _CLIENT_ID_RE.fullmatch(client_id) else "<invalid>"
        lock, waiting = self._checking.setdefault(limit_key, (asyncio.Lock(), [0]))
        waiting[0] += 1
        try:
            async with lock:
                return await self._authenticate(client_id, limit_key, secret)
        finally:
            waiting[0] -= 1
            if not waiting[0]:
                del self._checking[limit_key]

    async def _authenticate(self, client_id: str, limit_key: str, secret: str) -> ClientRecord:
        wait = self.limiter.retry_after(limit_key)
        if wait > 0:
            log.info("authentication of %r refused: rate_limited (%.1fs left)", client_id, wait)
            raise TooManyAttempts(limit_key, wait)
        record = await self.get(client_id)
        encoded = record.secret_hash if record is not None else _dummy_hash()
        ok = await asyncio.to_thread(verify_secret, secret, encoded)
        if record is None or not ok:
            reason = "unknown_client" if record is None else "bad_secret"
            self.limiter.failure(limit_key)
            log.info("authentication of %r refused: %s", client_id, reason)
            raise CredentialsRejected(_GENERIC_REFUSAL, reason=reason, client_id=limit_key)
        if record.revoked:
            log.info("authentication of %r refused: revoked", client_id)
            raise CredentialsRejected(
                f"client {client_id} is revoked", reason="revoked", client_id=client_id
            )
        self.limiter.success(limit_key)
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
