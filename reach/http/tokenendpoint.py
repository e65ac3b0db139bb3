"""The token endpoint of the gateways' login: authlib's client-credentials grant over one
credential the fabric has just accepted.

The fabric checks the secret (``reach.http.oauth`` logs the credential in with the
token issuer first); authlib then validates the request as RFC 6749 says (the grant
type, how the client authenticated, the scope) and writes the answer or the error.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from authlib.oauth2 import AuthorizationServer, OAuth2Request
from authlib.oauth2.rfc6749 import ClientMixin
from authlib.oauth2.rfc6749.errors import InsecureTransportError
from authlib.oauth2.rfc6749.grants import ClientCredentialsGrant
from authlib.oauth2.rfc6749.requests import BasicOAuth2Payload
from authlib.oauth2.rfc6749.util import extract_basic_authorization
from starlette.responses import JSONResponse, Response

__all__ = ["basic_credentials", "oauth_error", "token_response"]


class _Client(ClientMixin):  # type: ignore[misc]
    """What authlib sees of a credential the fabric accepted a moment ago."""

    def __init__(self, client_id: str, secret: str) -> None:
        self.client_id = client_id
        self._secret = secret

    def get_client_id(self) -> str:
        return self.client_id

    def get_default_redirect_uri(self) -> None:
        return None

    def get_allowed_scope(self, scope: str) -> str:
        return ""

    def check_redirect_uri(self, redirect_uri: str) -> bool:
        return False

    def check_client_secret(self, client_secret: str) -> bool:
        return secrets.compare_digest(client_secret.encode(), self._secret.encode())

    def check_endpoint_auth_method(self, method: str, endpoint: str) -> bool:
        return endpoint == "token" and method in ("client_secret_basic", "client_secret_post")

    def check_response_type(self, response_type: str) -> bool:
        return False

    def check_grant_type(self, grant_type: str) -> bool:
        return grant_type == "client_credentials"


class _FormRequest(OAuth2Request):  # type: ignore[misc]
    def __init__(self, uri: str, headers: Mapping[str, str], form: dict[str, str]) -> None:
        super().__init__("POST", uri, headers=headers)
        self._form = form
        self.payload = BasicOAuth2Payload(form)

    @property
    def args(self) -> dict[str, str]:
        return {}

    @property
    def form(self) -> dict[str, str]:
        return self._form


class _ClientCredentials(ClientCredentialsGrant):  # type: ignore[misc]
    TOKEN_ENDPOINT_AUTH_METHODS: ClassVar[list[str]] = [
        "client_secret_basic",
        "client_secret_post",
    ]


class _Server(AuthorizationServer):  # type: ignore[misc]
    """authlib's token endpoint over one credential checked beforehand."""

    def __init__(self) -> None:
        super().__init__(scopes_supported=None)
        self.register_grant(_ClientCredentials)
        self.checked: _Client | None = None
        self.issue: Callable[[str], dict[str, Any]] | None = None
        self.register_token_generator("default", self._token)

    def query_client(self, client_id: str) -> _Client | None:
        checked = self.checked
        return checked if checked is not None and checked.client_id == client_id else None

    def save_token(self, token: dict[str, Any], request: OAuth2Request) -> None:
        return None

    def send_signal(self, name: str, *args: Any, **kwargs: Any) -> None:
        return None

    def create_oauth2_request(self, request: OAuth2Request) -> OAuth2Request:
        return request

    def handle_response(
        self, status: int, body: Any, headers: list[tuple[str, str]]
    ) -> tuple[int, Any, list[tuple[str, str]]]:
        return status, body, headers

    def _token(self, *, client: _Client, **_: Any) -> dict[str, Any]:
        assert self.issue is not None
        return self.issue(client.client_id)


def basic_credentials(headers: Mapping[str, str]) -> tuple[str | None, str | None]:
    """The client id and secret of an ``Authorization: Basic`` header (RFC 6749 2.3.1)."""
    client_id, secret = extract_basic_authorization(headers)
    return client_id, secret


def token_response(
    uri: str,
    headers: Mapping[str, str],
    form: dict[str, str],
    client: tuple[str, str],
    issue: Callable[[], dict[str, Any]],
) -> Response:
    """The token endpoint's answer to a request at ``uri`` whose credential ``client``
    (client id, secret) the fabric accepted: ``issue()`` makes the token."""
    try:
        request = _FormRequest(uri, headers, form)
    except InsecureTransportError as exc:
        return oauth_error(400, exc.error, exc.description)
    server = _Server()
    server.checked = _Client(*client)
    server.issue = lambda _client_id: issue()
    status, body, answer_headers = server.create_token_response(request)
    return Response(
        json.dumps(body),
        status_code=status,
        headers=dict(answer_headers),
        media_type="application/json",
    )


def oauth_error(status: int, error: str, description: str) -> Response:
    """An RFC 6749 5.2 error answer."""
    return JSONResponse(
        {"error": error, "error_description": description},
        status_code=status,
        headers={"cache-control": "no-store", "pragma": "no-cache"},
    )
