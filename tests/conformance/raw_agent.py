"""An Agent-Reach agent written from the protocol spec with nats-py, msgpack, PyJWT,
cryptography and jsonschema: no ``reach`` import.

It logs in with its credentials file, subscribes to its probe and capability subjects,
announces its manifest, heartbeats, and serves one capability: every call's token is
verified (EdDSA, the key ``pub.<kid>`` from REACH_KEYS, issuer ``reach``, audience
``call:<capability>:<agent_id>`` on its instance subject or ``call:<capability>`` on the
queue subject, expiry, the key's ``not_after``, revocations, clearance level), the input
and output are checked against the capability's schemas, failures are answered with the
uniform ``{kind, code, desc}``, a replayed request is refused, a repeated call id of the
same client is answered from memory (once its token is checked), and each call whose
request does not say ``au`` is written to REACH_AUDIT as a callee event (and its reply
says ``aud``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from jsonschema import Draft202012Validator
from nats.aio.client import Client
from nats.aio.msg import Msg

from .wire import Creds, WireError, body_of, connect, error, fabric_token, ok, pack, request, unpack

Handler = Callable[[Any], Awaitable[Any]]
LEEWAY = 30  # seconds of clock skew tolerated on a token's times
RECENT = 4096  # call ids remembered, with their replies, for retried calls
MAX_AHEAD_SEC = 24 * 3600  # the furthest ahead a call's deadline may lie


class RawAgent:
    def __init__(self, creds: Creds, agent_id: str, capability: dict[str, Any], handler: Handler):
        self.creds, self.agent_id, self.cap, self.handler = creds, agent_id, capability, handler
        self.name: str = capability["name"]
        self.level: int = capability.get("security_level", 1)
        self.inputs = Draft202012Validator(capability.get("input_schema", {}))
        self.outputs = Draft202012Validator(capability.get("output_schema", {}))
        self.interval = 1.0  # heartbeat interval (manifest health.interval_sec)
        self.instance_id = secrets.token_hex(8)
        self.started_at = time.time()
        self.served = 0
        self.last_completion_at: float | None = None  # Unix seconds
        #: replies by (client, idempotency key or call id), for a repeat of a call
        self.recent: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        #: (client, call id, attempt) served, until its deadline (Unix seconds): replays
        self.served_at: dict[tuple[str, str, Any], float] = {}
        self.keys: dict[str, tuple[Ed25519PublicKey, float | None]] = {}
        self.revoked: dict[str, float] = {}  # client id -> revoked_at (Unix seconds)
        self.nc: Client | None = None
        self.token = ""
        self._tasks: set[asyncio.Task[None]] = set()

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        self.nc = nc = await connect(self.creds)
        self.token = (await fabric_token(nc, self.creds))["token"]
        self.js = nc.jetstream()
        self.key_bucket = await self.js.key_value("REACH_KEYS")
        # key and revocation changes, as the server republishes them: no consumer
        await nc.subscribe("reach.v1.kv.REACH_KEYS.>", cb=self._on_key_change)
        info = await self.js.stream_info(
            "KV_REACH_KEYS", subjects_filter="$KV.REACH_KEYS.revoked.>"
        )
        for subject in info.state.subjects or {}:
            with contextlib.suppress(Exception):
                entry = await self.key_bucket.get(subject.removeprefix("$KV.REACH_KEYS."))
                self._revocation(entry.value or b"")
        # subscribe before announcing: the registrar probes a new instance at once
        await nc.subscribe(f"reach.v1.probe.{self.agent_id}", cb=self._on_probe)
        await nc.subscribe(f"reach.v1.cap.{self.name}.{self.agent_id}", cb=self._on_call)
        await nc.subscribe(f"reach.v1.cap.{self.name}", queue=self.name, cb=self._on_call)
        await nc.flush()
        await self.announce()
        self._spawn(self._heartbeats())

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.nc is not None:
            with contextlib.suppress(Exception):
                bye = request({"agent_id": self.agent_id, "instance_id": self.instance_id})
                await self.nc.request(f"reach.v1.bye.{self.agent_id}", bye, timeout=2)
            await self.nc.close()

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _control(self, body: Any) -> bytes:
        return request(body, tok=self.token, **{"from": self.agent_id})

    async def announce(self) -> None:
        assert self.nc is not None
        manifest = {
            "agent_id": self.agent_id,
            "agent_name": "conformance",
            "version": "1.0.0",
            "capabilities": [self.cap],
            "health": {"interval_sec": self.interval, "timeout_sec": 1.0},
        }
        body = {
            "manifest": manifest,
            "instance_id": self.instance_id,
            "started_at": self.started_at,
            "readiness": {"ready": True},
        }
        reply = await self.nc.request(f"reach.v1.announce.{self.agent_id}", self._control(body), 5)
        answer = body_of(reply.data)
        if not answer.get("accepted"):
            raise RuntimeError(f"announce refused: {answer.get('reason')}")

    async def _heartbeats(self) -> None:
        seq = 0
        while self.nc is not None:
            await asyncio.sleep(self.interval)
            seq += 1
            beat = {
                "agent_id": self.agent_id,
                "instance_id": self.instance_id,
                "seq": seq,
                "sent_at": time.time(),
                "in_flight": 0,
                "max_concurrency": 64,
                "completed": self.served,
                "last_completion_at": self.last_completion_at,
            }
            try:
                msg = await self.nc.request(f"reach.v1.hb.{self.agent_id}", self._control(beat), 2)
                if body_of(msg.data).get("reannounce"):
                    await self.announce()
            except Exception:  # the registrar is away: the next beat tries again
                continue

    async def _on_probe(self, msg: Msg) -> None:
        probe = {
            "agent_id": self.agent_id,
            "instance_id": self.instance_id,
            "in_flight": 0,
            "max_concurrency": 64,
            "last_completion_at": self.last_completion_at,
            "readiness": {"ready": True},
        }
        await msg.respond(ok(probe, self.agent_id))

    # -- tokens ------------------------------------------------------------------------

    async def _on_key_change(self, msg: Msg) -> None:
        key = msg.subject.removeprefix("reach.v1.kv.REACH_KEYS.")
        if key.startswith("pub."):
            self.keys.pop(key[4:], None)  # read again when next needed
        elif key.startswith("revoked."):
            deleted = (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE")
            if deleted:
                self.revoked.pop(key[8:], None)
            else:
                self._revocation(msg.data)

    def _revocation(self, data: bytes) -> None:
        record = unpack(data) if data else None
        if isinstance(record, dict) and isinstance(record.get("client_id"), str):
            self.revoked[record["client_id"]] = float(record["revoked_at"])

    async def _key(self, kid: str) -> tuple[Ed25519PublicKey, float | None]:
        if kid not in self.keys:
            entry = await self.key_bucket.get(f"pub.{kid}")
            record = unpack(entry.value or b"")
            if record.get("kid") != kid or record.get("alg") != "EdDSA":
                raise ValueError(f"key record pub.{kid} does not name it")
            raw = base64.urlsafe_b64decode(record["public_key"] + "==")
            self.keys[kid] = Ed25519PublicKey.from_public_bytes(raw), record.get("not_after")
        return self.keys[kid]

    async def verify(self, token: Any, audience: str) -> dict[str, Any]:
        """The claims of a genuine call token for ``audience``; WireError ``denied``
        otherwise. Whether its level suffices is the caller's to check."""
        if token is None:
            raise WireError("denied", "no_token", f"{self.name} requires a token")
        try:
            if not isinstance(token, str):
                raise ValueError("not a string")
            header = jwt.get_unverified_header(token)
            if header.get("alg") != "EdDSA" or not isinstance(header.get("kid"), str):
                raise ValueError("only EdDSA tokens with a kid")
            key, not_after = await self._key(header["kid"])
            claims: dict[str, Any] = jwt.decode(
                token,
                key,
                algorithms=["EdDSA"],
                audience=audience,
                issuer="reach",
                leeway=LEEWAY,
                options={"require": ["exp", "iat", "sub", "lvl"]},
            )
        except Exception as exc:  # every failure is the caller's: a denial, never a crash
            raise WireError("denied", "authentication_failed", f"token rejected: {exc}") from None
        if not_after is not None and claims["exp"] > not_after:
            raise WireError("denied", "authentication_failed", "token rejected: key retired")
        if claims["iat"] <= self.revoked.get(claims["sub"], float("-inf")):
            raise WireError("denied", "authentication_failed", "token rejected: client revoked")
        return claims

    # -- calls -------------------------------------------------------------------------

    async def _on_call(self, msg: Msg) -> None:
        if not msg.reply:
            return
        started = time.time()
        try:
            env = unpack(msg.data)
        except Exception:
            env = None
        if not isinstance(env, dict):  # a batch (never sent: no "batch" feature) or garbage
            await msg.respond(error("contract", "bad_batch", "one request map only", self.agent_id))
            return
        claims: dict[str, Any] = {}
        audited = not env.get("au")  # the caller says whether it records the call itself
        try:
            reply = await self._serve(msg.subject, env, claims, audited)
        except WireError as exc:
            reply = error(exc.kind, exc.code, exc.desc, self.agent_id)
            if audited:
                self._spawn(self._audit(env, claims, started, exc))
        else:
            if audited:
                self._spawn(self._audit(env, claims, started, None))
        await msg.respond(reply)

    async def _serve(
        self, subject: str, env: dict[str, Any], claims: dict[str, Any], audited: bool
    ) -> bytes:
        """The reply to one call, in the order of the protocol's section 9.6; ``claims``
        gets the verified token's (for the audit)."""
        if env.get("v") != 1:
            raise WireError("contract", "version", f"protocol version {env.get('v')!r}, not 1")
        # 2. the token, before anything else: no token, no work (and no reply from memory)
        instance = subject == f"reach.v1.cap.{self.name}.{self.agent_id}"
        audience = f"call:{self.name}:{self.agent_id}" if instance else f"call:{self.name}"
        claims.update(await self.verify(env.get("tok"), audience))
        level = claims["lvl"]
        if not isinstance(level, int) or level < self.level:
            desc = f"{self.name} requires clearance level {self.level}; holds {level}"
            raise WireError("denied", f"insufficient_level:{self.level}:{level}", desc)
        # 3. the deadline (none: this agent's own) and replay, per client
        now = time.time()
        deadline = env.get("dl")
        if not isinstance(deadline, int):
            deadline = int((now + 1.5 * self.cap.get("latency_sla_ms", 1000) / 1000) * 1000)
        elif deadline > (now + MAX_AHEAD_SEC) * 1000:
            raise WireError("denied", "deadline_too_far", "the deadline lies over 24 h ahead")
        seen = (str(claims["sub"]), str(env.get("id", "")), env.get("at"))
        self._forget_served(now)
        if seen in self.served_at:
            raise WireError("denied", "replayed", f"call {seen[1]} attempt {seen[2]} replayed")
        self.served_at[seen] = deadline / 1000
        # 4. a deadline passed
        if deadline < now * 1000:
            raise WireError("timeout", "deadline_passed", "the call's deadline has passed")
        # 5. a repeat of a call this client made is answered as the first time
        key = (str(claims["sub"]), str(env.get("ik") or env.get("id", "")))
        if key[1] and key in self.recent:
            return self.recent[key]
        reply = await self._run(env, audited)
        if key[1]:
            self.recent[key] = reply
            while len(self.recent) > RECENT:
                self.recent.popitem(last=False)
        return reply

    def _forget_served(self, now: float) -> None:
        for seen, until in list(self.served_at.items()):
            if until < now:
                del self.served_at[seen]

    async def _run(self, env: dict[str, Any], audited: bool) -> bytes:
        """Steps 7 to 10: the input checked, the handler run, its output checked."""
        try:
            payload = unpack(env.get("b", b""))
        except Exception:
            raise WireError("contract", "input", "<root>: the body is not msgpack") from None
        problem = next(iter(self.inputs.iter_errors(payload)), None)
        if problem is not None:
            path = "/".join(str(p) for p in problem.absolute_path) or "<root>"
            raise WireError("contract", str(problem.validator), f"{path}: {problem.message}")
        try:
            result = await self.handler(payload)
        except Exception as exc:
            raise WireError("internal", type(exc).__name__, str(exc)) from None
        problem = next(iter(self.outputs.iter_errors(result)), None)
        if problem is not None:
            raise WireError("contract", "output", f"output: {problem.message}")
        self.served += 1
        self.last_completion_at = time.time()
        return ok(result, self.agent_id, **({"aud": True} if audited else {}))

    async def _audit(
        self, env: dict[str, Any], claims: dict[str, Any], started: float, exc: WireError | None
    ) -> None:
        """One callee event in REACH_AUDIT, a batch of rows under its own client id."""
        assert self.nc is not None
        fields = ["side", "ts", "capability", "call_id", "caller", "caller_agent", "callee"]
        fields += ["outcome", "error", "code", "description", "latency_ms"]
        outcome = "ok" if exc is None else ("denied" if exc.kind == "denied" else "error")
        row = [
            "callee",
            started,
            self.name,
            str(env.get("id", "")),
            str(claims.get("sub", "")),
            env.get("from"),
            self.agent_id,
            outcome,
            None if exc is None else exc.kind,
            "" if exc is None else exc.code,
            "" if exc is None else exc.desc[:200],
            (time.time() - started) * 1000.0,
        ]
        attempt_fields = ["agent_id", "score", "outcome", "latency_ms"]
        batch = {"v": 4, "fields": fields, "attempt_fields": attempt_fields, "events": [row]}
        subject = f"reach.v1.audit.{self.name}.{self.creds.client_id}"
        with contextlib.suppress(Exception):  # auditing never fails a call
            await self.js.publish(subject, pack(batch), timeout=5)
