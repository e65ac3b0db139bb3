"""The Agent-Reach wire protocol as a third party implements it from the docs, with
nats-py and msgpack only (no ``reach`` import here, nor in the caller and the agent
built on it): logging in, the envelope, call-reply subjects and the token service.

What it follows (schemas/README.md, the protocol spec):

* a credentials file is JSON ``{url, client_id, secret}``; a client logs in to NATS
  with user = client id, password = secret, and its inbox prefix ``_INBOX.<client_id>``
  (it may subscribe nowhere else for replies);
* every request and reply is a msgpack map (the envelope) whose ``b`` holds the body,
  itself msgpack, as bin bytes; requests to the token service are wrapped too;
* replies from agents come to call-reply subjects ``_INBOX.<client_id>.r.<base>.<token>``
  (both parts random): agents may publish nowhere else in a client's inbox.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import nats
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

TOKEN_SUBJECT = "reach.v1.auth.token"


@dataclass(frozen=True)
class Creds:
    url: str
    client_id: str
    secret: str

    @classmethod
    def load(cls, path: Path) -> Creds:
        data = json.loads(path.read_text())
        return cls(str(data["url"]), str(data["client_id"]), str(data["secret"]))


class WireError(Exception):
    """A reply with ``ok: false``: its ``err`` map's kind, code and description."""

    def __init__(self, kind: str, code: str, desc: str) -> None:
        super().__init__(f"{kind}/{code}: {desc}")
        self.kind, self.code, self.desc = kind, code, desc


async def connect(creds: Creds, url: str | None = None) -> Client:
    """A NATS connection logged in with ``creds`` (the server asks the fabric's login gate)."""
    return await nats.connect(
        servers=[url or creds.url],
        user=creds.client_id,
        password=creds.secret,
        inbox_prefix=f"_INBOX.{creds.client_id}",
        name=creds.client_id,
        max_reconnect_attempts=3,
    )


def pack(value: Any) -> bytes:
    data: bytes = msgpack.packb(value, use_bin_type=True)
    return data


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False)


def request(body: Any, **meta: Any) -> bytes:
    """A request envelope: version, a fresh call id (unless ``meta`` names one), the body.
    Optional keys (``tok``, ``dl``, ``at``, ``from``) are left out rather than sent nil."""
    env = {"v": 1, "id": secrets.token_hex(8), "b": pack(body)}
    env.update({k: v for k, v in meta.items() if v is not None})
    return pack(env)


def ok(body: Any, by: str, **extra: Any) -> bytes:
    return pack({"v": 1, "ok": True, "b": pack(body), "by": by, **extra})


def error(kind: str, code: str, desc: str, by: str) -> bytes:
    return pack({"v": 1, "ok": False, "err": {"kind": kind, "code": code, "desc": desc}, "by": by})


def body_of(reply: bytes) -> Any:
    """The body of a reply envelope; WireError if it says the call failed."""
    env = unpack(reply)
    if not isinstance(env, dict) or env.get("v") != 1:
        raise WireError("contract", "bad_reply", "not a version 1 reply envelope")
    if not env.get("ok"):
        err = env.get("err") or {}
        raise WireError(str(err.get("kind")), str(err.get("code", "")), str(err.get("desc", "")))
    return unpack(env["b"])


async def ask(nc: Client, client_id: str, subject: str, data: bytes, timeout: float) -> bytes:
    """Publish ``data`` with a fresh call-reply subject and return the one reply."""
    base = f"_INBOX.{client_id}.r.{secrets.token_hex(8)}"
    sub = await nc.subscribe(f"{base}.*", max_msgs=1)
    try:
        await nc.publish(subject, data, reply=f"{base}.{secrets.token_hex(8)}")
        msg: Msg = await sub.next_msg(timeout=timeout)
    finally:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()
    if msg.headers and msg.headers.get("Status") == "503":
        raise WireError("unavailable", "no_responders", f"nobody serves {subject}")
    return bytes(msg.data)


async def token_service(nc: Client, creds: Creds, **fields: Any) -> dict[str, Any]:
    """One request to the token service, wrapped in the envelope: the token-reply map."""
    body = {"client_id": creds.client_id, **fields}
    reply = await ask(nc, creds.client_id, TOKEN_SUBJECT, request(body), 5.0)
    answer: dict[str, Any] = body_of(reply)
    return answer


async def fabric_token(nc: Client, creds: Creds) -> dict[str, Any]:
    """Step one: client id + secret for a fabric token (for the fabric's own services)."""
    return await token_service(nc, creds, secret=creds.secret)


async def call_token(
    nc: Client, creds: Creds, fabric: str, capability: str, instance: str | None
) -> dict[str, Any]:
    """Step two: the fabric token for a call token of one instance (or, with no instance,
    of the capability's queue group)."""
    return await token_service(nc, creds, token=fabric, audience=capability, instance=instance)
