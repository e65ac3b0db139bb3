"""The envelope around every request and reply body.

Call metadata travels in a small msgpack map around the body rather than in NATS
headers (one msgpack map is cheaper to build and parse than NATS headers; nats-py also
echoes request headers in replies, which must never carry a token back). The body stays
pre-encoded bytes, so a callee can check the metadata (token, deadline) before decoding
the payload.

Request: ``{"v": 1, "id": call_id, "b": body, "tok"?, "dl"?, "ik"?, "at"?, "tp"?, "ts"?,
"from"?, "au"?}``
Reply:   ``{"v": 1, "ok": true, "b": body, "by"?, "job"?, "aud"?}`` or
         ``{"v": 1, "ok": false, "err": {"kind", "code", "desc", "path"?}, "by"?}``

Audit: a caller that records its calls in REACH_AUDIT says so (``"au": true``); the
callee of a request without it records the call itself, and says so in its ok reply
(``"aud": true``). So every call is recorded once, by its caller or else by its callee,
whatever language either is written in (docs/protocol.md).

Batch:   ``[[token, request], ...]`` (a msgpack array, where a request is a map): the
         requests a caller sent to one subject in one turn of its event loop, in one NATS
         message. Each is served as if it came alone; the replies go to the batch's reply
         subject as ``[[token, reply], ...]``, as many per message as are ready together.
         A reply that is a map, not an array, refuses the batch as a whole: none of its
         requests ran, and the caller sends each again alone. At most ``MAX_BATCH_ITEMS``
         requests.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgpack

from reach.errors import CodecError
from reach.wire.codec import not_msgpack, packb, reject_ext
from reach.wire.plain import Plain

__all__ = [
    "MAX_BATCH_ITEMS",
    "PROTOCOL_VERSION",
    "Reply",
    "RequestMeta",
    "is_batch",
    "pack_batch",
    "pack_error",
    "pack_ok",
    "pack_request",
    "unpack_batch",
    "unpack_reply",
    "unpack_request",
]

PROTOCOL_VERSION = 1
_MAX_META_STR = 4096
#: requests in one batch, at most (a callee refuses a longer one as a whole)
MAX_BATCH_ITEMS = 32
_MAX_TOKEN = 32
ERROR_KINDS = frozenset({"contract", "business", "unavailable", "denied", "timeout", "internal"})


_META_NAMES = (
    "call_id",
    "token",
    "deadline_ms",
    "idempotency_key",
    "attempt",
    "traceparent",
    "tracestate",
    "caller",
    "audit",
)


class RequestMeta(Plain):
    """What travels with a call besides its payload.

    A plain class, not a dataclass: one is built for every call on each side, and
    compiled (``make build``) its constructor costs much less than a dataclass's.
    """

    _NAMES = _META_NAMES
    __slots__ = _META_NAMES

    def __init__(
        self,
        call_id: str,
        token: str | None = None,
        deadline_ms: int | None = None,
        idempotency_key: str | None = None,
        attempt: int = 1,
        traceparent: str | None = None,
        tracestate: str | None = None,
        caller: str | None = None,
        audit: bool = False,
    ) -> None:
        self.call_id = call_id
        self.token = token
        self.deadline_ms = deadline_ms
        self.idempotency_key = idempotency_key
        self.attempt = attempt
        self.traceparent = traceparent
        self.tracestate = tracestate
        self.caller = caller
        #: the caller records this call in REACH_AUDIT (else its callee does)
        self.audit = audit


class Reply(NamedTuple):
    """A decoded reply (a named tuple: built on every call, so cheap to build)."""

    ok: bool
    body: bytes = b""
    kind: str = ""
    code: str = ""
    description: str = ""
    by: str = ""
    #: set when an async-mode agent accepted the call as a job
    job: str = ""
    #: the callee recorded the call in REACH_AUDIT (an ok reply's ``aud``: its request
    #: did not say its caller records it)
    audited: bool = False
    #: a contract error's field (``err.path``), "" when the callee named none
    path: str = ""


def pack_request(meta: RequestMeta, body: bytes) -> bytes:
    env: dict[str, Any] = {"v": PROTOCOL_VERSION, "id": meta.call_id, "b": body}
    if meta.token is not None:
        env["tok"] = meta.token
    if meta.deadline_ms is not None:
        env["dl"] = meta.deadline_ms
    if meta.idempotency_key is not None:
        env["ik"] = meta.idempotency_key
    if meta.attempt != 1:
        env["at"] = meta.attempt
    if meta.traceparent is not None:
        env["tp"] = meta.traceparent
    if meta.tracestate is not None:
        env["ts"] = meta.tracestate
    if meta.caller is not None:
        env["from"] = meta.caller
    if meta.audit:
        env["au"] = True
    data: bytes = packb(env)
    return data


def _unpack_map(data: bytes, what: str, max_bytes: int) -> dict[str, Any]:
    if len(data) > max_bytes:
        raise CodecError(
            f"{what} is {len(data)} bytes, more than the limit of {max_bytes}", rule="max_bytes"
        )
    try:
        env = msgpack.unpackb(
            data, raw=False, max_array_len=64, max_map_len=64, ext_hook=reject_ext
        )
    except CodecError:
        raise
    except Exception as exc:  # msgpack raises a wide set of types on garbage
        raise not_msgpack(f"{what} is not a valid envelope", exc) from None
    if not isinstance(env, dict):
        raise CodecError(f"{what} must be a msgpack map, got {type(env).__name__}", rule="format")
    version = env.get("v")
    if version != PROTOCOL_VERSION:
        raise CodecError(f"{what}: unsupported protocol version {version!r}", path="v")
    return env


def unpack_request(
    data: bytes, max_bytes: int = 1024 * 1024 + 16 * 1024
) -> tuple[RequestMeta, bytes]:
    env = _unpack_map(data, "request", max_bytes)
    call_id = env.get("id")
    if not isinstance(call_id, str) or not 0 < len(call_id) <= 128:
        raise CodecError("request: 'id' (call id) must be a non-empty string", path="id")
    body = env.get("b", b"")
    if not isinstance(body, bytes):
        raise CodecError("request: 'b' (body) must be bytes", path="b")
    deadline = env.get("dl")
    if deadline is not None and type(deadline) is not int:
        raise CodecError("request: 'dl' (deadline) must be Unix milliseconds", path="dl")
    attempt = env.get("at", 1)
    if type(attempt) is not int or not 1 <= attempt <= 100:
        raise CodecError("request: 'at' (attempt) must be an integer from 1", path="at")
    audit = env.get("au", False)
    if type(audit) is not bool:
        raise CodecError("request: 'au' (the caller audits) must be true or false", path="au")
    token = env.get("tok")
    idempotency_key = env.get("ik")
    traceparent = env.get("tp")
    tracestate = env.get("ts")
    caller = env.get("from")
    # each absent (the common case for most) or a short string: one test for all five
    if not (
        (token is None or (type(token) is str and len(token) <= _MAX_META_STR))
        and (
            idempotency_key is None
            or (type(idempotency_key) is str and len(idempotency_key) <= _MAX_META_STR)
        )
        and (
            traceparent is None or (type(traceparent) is str and len(traceparent) <= _MAX_META_STR)
        )
        and (tracestate is None or (type(tracestate) is str and len(tracestate) <= _MAX_META_STR))
        and (caller is None or (type(caller) is str and len(caller) <= _MAX_META_STR))
    ):
        _bad_meta_str(env)
    return RequestMeta(
        call_id,
        token,
        deadline,
        idempotency_key,
        attempt,
        traceparent,
        tracestate,
        caller,
        audit,
    ), body


#: the optional strings of a request, by key, and what each is
_META_STRS = (
    ("tok", "token"),
    ("ik", "idempotency_key"),
    ("tp", "traceparent"),
    ("ts", "tracestate"),
    ("from", "caller"),
)


def _bad_meta_str(env: dict[str, Any]) -> None:
    """Raise the error naming the first optional string that is not a short string."""
    for key, name in _META_STRS:
        value = env.get(key)
        if value is not None and not (type(value) is str and len(value) <= _MAX_META_STR):
            raise CodecError(f"request: {key!r} ({name}) must be a short string", path=key)


def pack_ok(body: bytes, by: str = "", job: str = "", audited: bool = False) -> bytes:
    env: dict[str, Any] = {"v": PROTOCOL_VERSION, "ok": True, "b": body}
    if by:
        env["by"] = by
    if job:
        env["job"] = job
    if audited:
        env["aud"] = True
    data: bytes = packb(env)
    return data


def pack_error(kind: str, code: str, description: str, by: str = "", path: str = "") -> bytes:
    """A failed reply; ``path`` names the field of a contract error (left out when "")."""
    err: dict[str, str] = {"kind": kind, "code": code, "desc": description[:_MAX_META_STR]}
    if path:
        err["path"] = path[:_MAX_META_STR]
    env: dict[str, Any] = {"v": PROTOCOL_VERSION, "ok": False, "err": err}
    if by:
        env["by"] = by
    data: bytes = packb(env)
    return data


def unpack_reply(data: bytes, max_bytes: int = 1024 * 1024 + 16 * 1024) -> Reply:
    env = _unpack_map(data, "reply", max_bytes)
    by = env.get("by", "")
    if not isinstance(by, str):
        by = ""
    if env.get("ok") is True:
        body = env.get("b", b"")
        if not isinstance(body, bytes):
            raise CodecError("reply: 'b' (body) must be bytes", path="b")
        job = env.get("job", "")
        if not isinstance(job, str) or len(job) > 256:
            raise CodecError("reply: 'job' (job id) must be a short string", path="job")
        # positional: a named tuple's keywords cost more than its fields
        return Reply(True, body, "", "", "", by, job, env.get("aud") is True)
    err = env.get("err")
    if not isinstance(err, dict):
        raise CodecError("reply: a failed reply must carry 'err'", path="err")
    kind, code, desc = err.get("kind"), err.get("code", ""), err.get("desc", "")
    if not isinstance(kind, str) or kind not in ERROR_KINDS:  # a list kind is unhashable
        raise CodecError(f"reply: unknown error kind {kind!r}", path="err.kind")
    path = err.get("path", "")
    if not isinstance(path, str):  # a callee's oddity, not worth refusing the reply for
        path = ""
    return Reply(
        ok=False, kind=kind, code=str(code), description=str(desc), by=by, path=path[:_MAX_META_STR]
    )


def is_batch(data: bytes) -> bool:
    """Does ``data`` start a msgpack array (a batch) rather than a map (one envelope)?"""
    return bool(data) and (0x90 <= data[0] <= 0x9F or data[0] == 0xDC or data[0] == 0xDD)


def pack_batch(items: list[tuple[str, bytes]]) -> bytes:
    """``[[token, envelope], ...]``: requests (or replies) that travel together."""
    data: bytes = packb(items)
    return data


def unpack_batch(data: bytes, max_bytes: int = 4 * 1024 * 1024) -> list[tuple[str, bytes]]:
    """The (token, envelope bytes) pairs of a batch; CodecError names what is wrong."""
    if len(data) > max_bytes:
        raise CodecError(
            f"batch is {len(data)} bytes, more than the limit of {max_bytes}", rule="max_bytes"
        )
    try:
        items = msgpack.unpackb(
            data,
            raw=False,
            use_list=False,
            max_array_len=MAX_BATCH_ITEMS,
            max_map_len=0,
            ext_hook=reject_ext,
        )
    except CodecError:
        raise
    except Exception as exc:  # msgpack raises a wide set of types on garbage
        raise not_msgpack("not a valid batch", exc) from None
    if type(items) is not tuple or not items:
        raise CodecError("a batch must be a non-empty msgpack array", rule="format")
    for i, item in enumerate(items):
        if (
            type(item) is not tuple
            or len(item) != 2
            or type(item[0]) is not str
            or not 0 < len(item[0]) <= _MAX_TOKEN
            or type(item[1]) is not bytes
        ):
            raise CodecError(f"batch[{i}] must be [token, envelope bytes]", path=f"[{i}]")
    return list(items)
