"""Security core: credentials, rate limiting of wrong secrets, Ed25519 tokens.

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
"""

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
    TooManyAttempts,
    hash_secret,
    new_secret,
    read_private_file,
    verify_secret,
    write_private_file,
)
from reach.security.ratelimit import FailureLimiter
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
    "FailureLimiter",
    "KeyChange",
    "KeyRing",
    "KeyStore",
    "PublicKey",
    "RefusalLog",
    "SigningKey",
    "TokenIssuer",
    "TokenRejected",
    "TokenVerifier",
    "TooManyAttempts",
    "hash_secret",
    "new_secret",
    "read_private_file",
    "verify_secret",
    "write_private_file",
]
