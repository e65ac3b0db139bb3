"""Who may announce, heartbeat or deregister for an agent_id: the registrar's checks of a
control message, made before its body is decoded and before anything is applied.

On a secured fabric (one with a token verifier) a control message on
``reach.v1.<kind>.<agent_id>`` needs a token bound to that agent_id (operators and the
local dev credential, admins, may speak for any), and an announce may offer only the
capabilities the client's credential lists, each at a ``security_level`` no higher than
the clearance of the token it carries (an agent serves nothing above its credential's
level: it would be handed the payloads of callers cleared for more). A refused message
raises :class:`Denied`, which the registrar answers ``denied`` and audits.
"""

from __future__ import annotations

from typing import Final, TypeVar

from reach.errors import AuthenticationFailed, AuthError
from reach.security.credentials import ROLE_ADMIN, ROLE_REGISTRAR, CredentialStore
from reach.security.membership import FabricSecurity
from reach.security.tokens import Claims
from reach.transport import Connection, Message
from reach.wire import envelope, subjects
from reach.wire.codec import Limits
from reach.wire.modelcodec import decode_model
from reach.wire.models import AnnounceRequest, Bye, Heartbeat, Manifest

__all__ = ["ABOVE_CLEARANCE", "ControlMessage", "Denied", "MessageAuth", "above_clearance"]

ControlMessage = TypeVar("ControlMessage", AnnounceRequest, Heartbeat, Bye)

#: the code of a refusal to serve above the credential's clearance, with its arguments
#: ``above_clearance:<capability>:<security_level>:<clearance>``
ABOVE_CLEARANCE: Final = "above_clearance"


class Denied(AuthError):
    """A control message without the right token: answered ``denied``, never applied."""

    def __init__(self, code: str, message: str, *, call_id: str = "", client_id: str = "") -> None:
        self.code = code
        self.call_id = call_id
        self.client_id = client_id
        super().__init__(message)


class MessageAuth:
    """Decodes control messages and checks that their sender may send them."""

    def __init__(self, conn: Connection, limits: Limits) -> None:
        self._conn = conn
        self._limits = limits
        #: joined by the registrar on start; without a verifier nothing is checked
        self.security = FabricSecurity()
        #: opened on the first announce that needs it (secured fabrics only)
        self._credentials: CredentialStore | None = None

    def decode(self, cls: type[ControlMessage], msg: Message) -> ControlMessage:
        return self.decode_with_claims(cls, msg)[0]

    def decode_with_claims(
        self, cls: type[ControlMessage], msg: Message
    ) -> tuple[ControlMessage, Claims | None]:
        """The message's body as ``cls`` and its token's claims (None on an unsecured
        fabric); CodecError, ContractError or :class:`Denied` if it may not be applied."""
        meta, body = envelope.unpack_request(msg.data, self._limits.max_bytes)
        claims = None
        if self.security.verifier is not None:
            # before the body is decoded: only a token bound to this agent_id may speak for it
            claims = self.authorize(meta, subjects.last_token(msg.subject))
        return decode_model(cls, body, self._limits), claims

    def authorize(self, meta: envelope.RequestMeta, agent_id: str) -> Claims:
        """The claims of the message's token, if it may speak for ``agent_id``."""
        verifier = self.security.verifier
        assert verifier is not None
        if meta.token is None:
            raise Denied(
                "no_token", f"a token is required to speak for {agent_id}", call_id=meta.call_id
            )
        try:
            claims = verifier.verify(meta.token)
        except AuthenticationFailed as exc:
            raise Denied("authentication_failed", str(exc), call_id=meta.call_id) from None
        # operators and the local dev credential (admin) may speak for any agent
        if claims.agent_id != agent_id and not (
            claims.has_role(ROLE_REGISTRAR) or claims.has_role(ROLE_ADMIN)
        ):
            raise Denied(
                "wrong_agent",
                f"client {claims.client_id} is bound to agent_id {claims.agent_id!r},"
                f" not {agent_id!r}",
                call_id=meta.call_id,
                client_id=claims.client_id,
            )
        return claims

    async def check_mandate(self, claims: Claims | None, manifest: Manifest) -> None:
        """Denied unless the client may serve what ``manifest`` offers: an agent
        credential serves the capabilities it lists (``reach creds add --cap``) and no
        others; one that lists none serves none. Only admins (and the registrar) may
        announce any capability. NATS permissions hold the same line on the subscription
        side. Every credential, admins' too, serves only capabilities at or below its
        clearance. An open fabric (no claims) checks nothing."""
        if claims is None:
            return
        if not (claims.has_role(ROLE_REGISTRAR) or claims.has_role(ROLE_ADMIN)):
            await self._check_listed(claims, manifest)
        denied = above_clearance(claims, manifest)
        if denied is not None:
            raise denied

    async def _check_listed(self, claims: Claims, manifest: Manifest) -> None:
        """Denied unless the client's credential lists every capability of ``manifest``."""
        if self._credentials is None:
            self._credentials = await CredentialStore.open(self._conn, create=False)
        record = await self._credentials.get(claims.client_id)
        allowed = set(record.capabilities) if record is not None and not record.revoked else set()
        extra = sorted({c.name for c in manifest.capabilities} - allowed)
        if extra:
            may = ", ".join(sorted(allowed)) or "no capability (reach creds add --cap NAME)"
            raise Denied(
                "capability_not_allowed",
                f"client {claims.client_id} may serve {may}; not {', '.join(extra)}",
                client_id=claims.client_id,
            )


def above_clearance(claims: Claims, manifest: Manifest) -> Denied | None:
    """The refusal of an instance whose ``manifest`` offers a capability above the
    clearance of the token ``claims`` (code ``above_clearance:<capability>:<level>:<held>``,
    naming the first such capability; the message names them all), or None."""
    held = claims.level
    if manifest.highest_level <= held:
        return None
    above = [cap for cap in manifest.capabilities if cap.security_level > held]
    first = above[0]
    named = ", ".join(f"{cap.name} at security_level {cap.security_level}" for cap in above)
    return Denied(
        f"{ABOVE_CLEARANCE}:{first.name}:{first.security_level}:{held}",
        f"client {claims.client_id} holds clearance {held} and may not serve {named}:"
        " an agent serves no capability above its credential's level",
        client_id=claims.client_id,
    )
