"""The token exchange's two messages: what a client asks the issuer on
``reach.v1.auth.token`` and what it answers.

Both sides import them: the issuer (``reach.security.issuer``) and every client's token
session (``reach.security.session``), which therefore loads nothing of the issuer's.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from reach.security.claims import MAX_TOKEN_CHARS
from reach.wire.models import SubjectToken

__all__ = ["TokenReply", "TokenRequest"]


class TokenRequest(BaseModel):
    """A login (``secret``: a fabric token) or an exchange (``token``, the client's valid
    fabric token, ``audience``, a capability, and ``instance``, the agent id of one of
    its instances: a token for calls to that instance; without ``instance``, for calls
    to the capability's queue group).

    ``actor_token``, in an exchange: the fabric token of a gateway calling for the
    client, whose fabric token it holds because the client logged in through it. The
    call token then names the gateway as its actor (RFC 8693 ``act``); only a credential
    with the ``gateway`` role may act for others."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    client_id: str = Field(min_length=1, max_length=64)
    secret: str | None = Field(None, min_length=1, max_length=512)
    token: str | None = Field(None, min_length=1, max_length=MAX_TOKEN_CHARS)
    audience: SubjectToken | None = None
    instance: SubjectToken | None = None
    actor_token: str | None = Field(None, min_length=1, max_length=MAX_TOKEN_CHARS)

    @model_validator(mode="after")
    def _one_proof(self) -> TokenRequest:
        if (self.secret is None) == (self.token is None):
            raise ValueError("give either secret or token")
        if self.token is not None and self.audience is None:
            raise ValueError("an exchange of a token names its audience (a capability)")
        if self.instance is not None and self.audience is None:
            raise ValueError("an instance is one of a capability's: name the audience too")
        if self.actor_token is not None and self.token is None:
            raise ValueError("an actor_token acts in an exchange: give the client's token too")
        return self


class TokenReply(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    token: str
    expires_at: float = Field(description="Unix seconds")
    level: int
    agent_id: str | None = None
