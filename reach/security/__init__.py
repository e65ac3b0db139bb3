"""Security core: credentials, Ed25519 tokens.

Pure building blocks; the agent, client, registrar and CLI wire them together::

    store = await CredentialStore.open(conn)             # REACH_CREDENTIALS
    record, secret = await store.add("report-gen", 2, agent_id="report-gen-001")
    record = await store.authenticate("report-gen", secret)

    ring = KeyRing.load_or_generate(store_dir / "signing.key")
    issuer = TokenIssuer(ring)
    token = issuer.issue(record)

    keys = await KeyStore.open(conn)                     # REACH_KEYS, public keys only
    await keys.publish_ring(ring)
    verifier = TokenVerifier()
    asyncio.create_task(keys.follow(verifier, ready))    # learn (and forget) keys live
    claims = verifier.verify(token)                      # TokenRejected names the failed check

The names below are imported on first use, so that importing one module of the package
does not load the others (``reach.security.replay`` does not load the credential store).
"""

import typing as _typing

from reach import lazy as _lazy

if _typing.TYPE_CHECKING:
    from reach.security.credcache import CredentialCache
    from reach.security.credentials import (
        KNOWN_ROLES,
        ROLE_ADMIN,
        ROLE_JOBS,
        ROLE_REGISTRAR,
        ClientRecord,
        CredentialsFile,
        CredentialsRejected,
        CredentialStore,
        hash_secret,
        new_secret,
        read_private_file,
        verify_secret,
        write_private_file,
    )
    from reach.security.refusals import RefusalLog
    from reach.security.tokens import (
        ALGORITHM,
        DEFAULT_AUDIENCE,
        DEFAULT_ISSUER,
        DEFAULT_LEEWAY_SEC,
        DEFAULT_TTL_SEC,
        Claims,
        KeyChange,
        KeyRing,
        KeyStore,
        PublicKey,
        SigningKey,
        TokenIssuer,
        TokenRejected,
        TokenVerifier,
    )

__all__ = [
    "ALGORITHM",
    "DEFAULT_AUDIENCE",
    "DEFAULT_ISSUER",
    "DEFAULT_LEEWAY_SEC",
    "DEFAULT_TTL_SEC",
    "KNOWN_ROLES",
    "ROLE_ADMIN",
    "ROLE_JOBS",
    "ROLE_REGISTRAR",
    "Claims",
    "ClientRecord",
    "CredentialCache",
    "CredentialStore",
    "CredentialsFile",
    "CredentialsRejected",
    "KeyChange",
    "KeyRing",
    "KeyStore",
    "PublicKey",
    "RefusalLog",
    "SigningKey",
    "TokenIssuer",
    "TokenRejected",
    "TokenVerifier",
    "hash_secret",
    "new_secret",
    "read_private_file",
    "verify_secret",
    "write_private_file",
]

#: each public name and the module it is imported from
_EXPORTS: dict[str, str] = {
    "ALGORITHM": "reach.security.tokens",
    "DEFAULT_AUDIENCE": "reach.security.tokens",
    "DEFAULT_ISSUER": "reach.security.tokens",
    "DEFAULT_LEEWAY_SEC": "reach.security.tokens",
    "DEFAULT_TTL_SEC": "reach.security.tokens",
    "KNOWN_ROLES": "reach.security.credentials",
    "ROLE_ADMIN": "reach.security.credentials",
    "ROLE_JOBS": "reach.security.credentials",
    "ROLE_REGISTRAR": "reach.security.credentials",
    "Claims": "reach.security.tokens",
    "ClientRecord": "reach.security.credentials",
    "CredentialCache": "reach.security.credcache",
    "CredentialStore": "reach.security.credentials",
    "CredentialsFile": "reach.security.credentials",
    "CredentialsRejected": "reach.security.credentials",
    "KeyChange": "reach.security.tokens",
    "KeyRing": "reach.security.tokens",
    "KeyStore": "reach.security.tokens",
    "PublicKey": "reach.security.tokens",
    "RefusalLog": "reach.security.refusals",
    "SigningKey": "reach.security.tokens",
    "TokenIssuer": "reach.security.tokens",
    "TokenRejected": "reach.security.tokens",
    "TokenVerifier": "reach.security.tokens",
    "hash_secret": "reach.security.credentials",
    "new_secret": "reach.security.credentials",
    "read_private_file": "reach.security.credentials",
    "verify_secret": "reach.security.credentials",
    "write_private_file": "reach.security.credentials",
}

if not _typing.TYPE_CHECKING:  # type checkers read the imports above instead
    __getattr__, __dir__ = _lazy.exports(__name__, _EXPORTS, globals(), __all__)
