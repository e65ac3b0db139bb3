"""JWTs as nats-io/jwt v2 writes them, signed with an nkey (``ed25519-nkey``): what the
auth callout reads (the server's authorization requests) and writes (its answers)."""

from __future__ import annotations

import base64
import binascii
import json
import secrets
import time
from typing import Any

from reach.security import natsconf

__all__ = ["decode_jwt", "encode_jwt"]

_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def encode_jwt(claims: dict[str, Any], key: natsconf.NKey) -> str:
    """Sign ``claims`` (``iss``, ``iat``, ``jti`` filled in) as an ``ed25519-nkey`` JWT."""
    body = {"jti": _b64(secrets.token_bytes(24)), "iat": int(time.time()), **claims}
    body["iss"] = key.public_key
    head = _b64(json.dumps(_HEADER, separators=(",", ":")).encode())
    payload = _b64(json.dumps(body, separators=(",", ":")).encode())
    signed = f"{head}.{payload}"
    return f"{signed}.{_b64(key.sign(signed.encode()))}"


def decode_jwt(token: str) -> dict[str, Any]:
    """The claims of an nkey-signed JWT whose signature by its own ``iss`` checks out.

    ValueError otherwise. Whether that issuer is trusted is the caller's decision.
    """
    parts = token.split(".")
    if len(parts) != 3:
        raise ValueError("not a JWT")
    try:
        header = json.loads(_unb64(parts[0]))
        claims = json.loads(_unb64(parts[1]))
        signature = _unb64(parts[2])
    except (ValueError, binascii.Error) as exc:
        raise ValueError("malformed JWT") from exc
    if not isinstance(header, dict) or header.get("alg") != _HEADER["alg"]:
        raise ValueError("JWT algorithm must be ed25519-nkey")
    if not isinstance(claims, dict) or not isinstance(claims.get("iss"), str):
        raise ValueError("JWT without issuer")
    if not natsconf.verify_signature(claims["iss"], f"{parts[0]}.{parts[1]}".encode(), signature):
        raise ValueError("bad JWT signature")
    return claims
