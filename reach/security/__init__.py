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
    from reach.security.credcache import CredentialCache as CredentialCache
    from reach.security.credentials import KNOWN_ROLES as KNOWN_ROLES
    from reach.security.credentials import ROLE_ADMIN as ROLE_ADMIN
    from reach.security.credentials import ROLE_JOBS as ROLE_JOBS
    from reach.security.credentials import ROLE_REGISTRAR as ROLE_REGISTRAR
    from reach.security.credentials import ClientRecord as ClientRecord
    from reach.security.credentials import CredentialsFile as CredentialsFile
    from reach.security.credentials import CredentialsRejected as CredentialsRejected
    from reach.security.credentials import CredentialStore as CredentialStore
    from reach.security.credentials import hash_secret as hash_secret
    from reach.security.credentials import new_secret as new_secret
    from reach.security.credentials import read_private_file as read_private_file
    from reach.security.credentials import verify_secret as verify_secret
    from reach.security.credentials import write_private_file as write_private_file
    from reach.security.refusals import RefusalLog as RefusalLog
    from reach.security.tokens import ALGORITHM as ALGORITHM
    from reach.security.tokens import DEFAULT_AUDIENCE as DEFAULT_AUDIENCE
    from reach.security.tokens import DEFAULT_ISSUER as DEFAULT_ISSUER
    from reach.security.tokens import DEFAULT_LEEWAY_SEC as DEFAULT_LEEWAY_SEC
    from reach.security.tokens import DEFAULT_TTL_SEC as DEFAULT_TTL_SEC
    from reach.security.tokens import Claims as Claims
    from reach.security.tokens import KeyChange as KeyChange
    from reach.security.tokens import KeyRing as KeyRing
    from reach.security.tokens import KeyStore as KeyStore
    from reach.security.tokens import PublicKey as PublicKey
    from reach.security.tokens import SigningKey as SigningKey
    from reach.security.tokens import TokenIssuer as TokenIssuer
    from reach.security.tokens import TokenRejected as TokenRejected
    from reach.security.tokens import TokenVerifier as TokenVerifier

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
__all__ = list(_EXPORTS)

if not _typing.TYPE_CHECKING:  # type checkers read the imports above instead
    __getattr__, __dir__ = _lazy.exports(__name__, _EXPORTS, globals(), __all__)
