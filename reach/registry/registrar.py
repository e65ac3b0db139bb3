"""The registrar: accepts announces, follows heartbeats, probes instances, evicts the dead.

State lives in the KV bucket, never only in memory: every write is a compare-and-set on
the revision this registrar last saw, so several registrars can run at once and a
restart loses nothing. Each registrar keeps a view of the bucket through a watch.
Probing and eviction of an instance is done by one registrar, chosen by rendezvous
hashing over the live registrars, so work is split and taken over when one dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from reach import envelope, subjects
from reach.audit.alerts import AlertRules, AlertWatcher
from reach.audit.events import REGISTRY_CAPABILITY, denial_event
from reach.audit.streams import StreamSettings, ensure_streams
from reach.audit.writer import AuditWriter
from reach.clock import Clock, system_clock
from reach.codec import Limits
from reach.errors import (
    AuthenticationFailed,
    AuthError,
    CodecError,
    ContractError,
    NoResponders,
    ReachError,
)
from reach.jobs import JOB_RETENTION_SEC, JobStore
from reach.messages import decode_model, encode_model
from reach.models import (
    AnnounceReply,
    AnnounceRequest,
    Bye,
    HealthStatus,
    Heartbeat,
    HeartbeatReply,
    Instance,
    Manifest,
    Readiness,
    RegistrarRecord,
    Transition,
    clip_reason,
)
from reach.registry.probe import ProbeResult, probe
from reach.registry.store import RegistryStore
from reach.security.credentials import ROLE_ADMIN, ROLE_REGISTRAR, CredentialStore
from reach.security.fabric import FabricSecurity
from reach.security.tokens import Claims
from reach.tasks import cancel_and_wait
from reach.transport import Connection, KVConflict, Message, Subscription

__all__ = ["Registrar", "RegistrarConfig"]


class _Denied(AuthError):
    """A control message without the right token: answered ``denied``, never applied."""

    def __init__(self, code: str, message: str, *, call_id: str = "", client_id: str = "") -> None:
        self.code = code
        self.call_id = call_id
        self.client_id = client_id
        super().__init__(message)


log = logging.getLogger("reach.registrar")

_CAS_ATTEMPTS = 8
_M = TypeVar("_M", AnnounceRequest, Heartbeat, Bye)
MessageHandler = Callable[[Message], Awaitable[None]]


@dataclass
class RegistrarConfig:
    registrar_id: str = field(default_factory=lambda: f"reg-{secrets.token_hex(4)}")
    #: KV replicas (3 on a NATS cluster)
    replicas: int = 1
    #: an instance silent for this many health intervals is removed from the registry
    evict_after_intervals: float = 3.0
    #: instances younger than this are probed twice as often
    new_agent_window_sec: float = 24 * 3600.0
    #: how often this registrar refreshes its own liveness record
    liveness_interval_sec: float = 1.0
    #: a record registered this recently counts as live even if it does not answer a probe yet
    duplicate_grace_sec: float = 1.0
    max_message_bytes: int = 256 * 1024
    max_concurrent_probes: int = 512
    #: announces, heartbeats and byes being handled at once above which this registrar is
    #: behind: it then evicts nobody and marks nobody unhealthy for silence until it has
    #: caught up (their heartbeats may be among those waiting), rather than turning its own
    #: overload into evictions, re-announces and more load
    max_backlog: int = 1000
    transitions_kept: int = 20
    job_retention_sec: float = JOB_RETENTION_SEC
    #: retention and replicas of REACH_AUDIT / REACH_ALERTS (replicas follow ``replicas``)
    streams: StreamSettings = field(default_factory=StreamSettings)
    #: alert rules; None runs no alert watcher in this registrar
    alerts: AlertRules | None = field(default_factory=AlertRules)
    clock: Clock = field(default=system_clock, repr=False)


class Registrar:
    """Keeps REACH_REGISTRY true to what runs. ``await start()``, ``await stop()``."""

    def __init__(self, conn: Connection, config: RegistrarConfig | None = None) -> None:
        self._conn = conn
        self.config = config or RegistrarConfig()
        self._clock = self.config.clock
        self._limits = Limits(max_bytes=self.config.max_message_bytes)
        self._store: RegistryStore | None = None
        self._records: dict[str, tuple[Instance, int]] = {}
        self._registrars: dict[str, RegistrarRecord] = {}
        self._owner_cache: dict[str, bool] = {}
        self._last_probe: dict[str, float] = {}
        #: per instance: (when, ms) of its latest successful probe that changed nothing
        #: and so was not written; the next heartbeat's write carries it (no write of its own)
        self._probed: dict[str, tuple[float, float]] = {}
        self._probing: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._subs: list[Subscription] = []
        self._loops: list[asyncio.Task[None]] = []
        self._synced = asyncio.Event()
        self._probe_slots = asyncio.Semaphore(self.config.max_concurrent_probes)
        self._started_at = 0.0
        #: when this registrar last could not keep the registry current (its watch
        #: failing, a failed sweep, a backlog of heartbeats, its connection coming back):
        #: silence is counted from then, not from the record, since heartbeats may have
        #: arrived and been lost
        self._trouble_at = 0.0
        #: per instance: when a heartbeat of it arrived that could not be written
        self._unrecorded: dict[str, float] = {}
        #: heartbeats being handled now (see ``RegistrarConfig.max_backlog``)
        self._handling = 0
        self._stopping = False
        self._security = FabricSecurity()
        #: opened on the first announce that needs it (secured fabrics only)
        self._credentials: CredentialStore | None = None
        self._audit: AuditWriter | None = None
        self._alerts: AlertWatcher | None = None
        self.denials = 0

    @property
    def registrar_id(self) -> str:
        return self.config.registrar_id

    @property
    def store(self) -> RegistryStore:
        if self._store is None:
            raise RuntimeError("start the registrar first")
        return self._store

    def instances(self) -> list[Instance]:
        """This registrar's current view of the registry."""
        return [inst for inst, _ in self._records.values()]

    async def start(self) -> None:
        self._security = await FabricSecurity.join(
            self._conn, None, verify=True, need_token=False, clock=self._clock
        )
        self._store = await RegistryStore.open(self._conn, replicas=self.config.replicas)
        # async-mode agents keep job results here; the bucket's TTL is the retention time
        await JobStore.open(
            self._conn,
            create=True,
            replicas=self.config.replicas,
            retention_sec=self.config.job_retention_sec,
        )
        streams = self.config.streams
        if streams.replicas != self.config.replicas:
            streams = dataclasses.replace(streams, replicas=self.config.replicas)
        await ensure_streams(self._conn, streams)
        self._audit = AuditWriter(self._conn)
        await self._audit.start()
        if self.config.alerts is not None:
            # fed by this registrar's own registry watch (no second decode of every record)
            self._alerts = AlertWatcher(self._conn, self.config.alerts, self._clock)
            await self._alerts.start()
        self._started_at = self._clock.time()
        # disconnected, it heard no heartbeats: silence counts from when it is back
        self._conn.on_reconnect(self._trouble)
        self._loops.append(asyncio.create_task(self._watch_loop(), name="registrar-watch"))
        await asyncio.wait_for(self._synced.wait(), 30)
        await self._refresh_liveness()
        for subject, handler in (
            (subjects.ANNOUNCE_ALL, self._on_announce),
            (subjects.HEARTBEAT_ALL, self._on_heartbeat),
            (subjects.BYE_ALL, self._on_bye),
        ):
            counted = subject == subjects.HEARTBEAT_ALL
            self._subs.append(
                await self._conn.subscribe(
                    subject,
                    self._spawning(handler, counted=counted),
                    queue=subjects.REGISTRAR_QUEUE,
                )
            )
        self._subs.append(await self._conn.subscribe(subjects.REGISTRAR_PING, self._on_ping))
        await self._conn.flush()
        self._loops.append(asyncio.create_task(self._sweep_loop(), name="registrar-sweep"))
        self._loops.append(asyncio.create_task(self._liveness_loop(), name="registrar-liveness"))
        log.info("registrar %s started with %d records", self.registrar_id, len(self._records))

    async def stop(self) -> None:
        self._stopping = True
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs.clear()
        await cancel_and_wait([*self._loops, *self._tasks])
        self._loops.clear()
        if self._alerts is not None:
            await self._alerts.stop()
        if self._audit is not None:
            await self._audit.stop(timeout=2.0)
        await self._security.close()
        if self._store is not None and not self._conn.is_closed:
            with contextlib.suppress(ReachError):
                await self._store.delete_registrar(self.registrar_id)

    async def __aenter__(self) -> Registrar:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _on_ping(self, msg: Message) -> None:
        record = RegistrarRecord(
            registrar_id=self.registrar_id,
            started_at=self._started_at,
            seen_at=self._clock.time(),
            interval_sec=self.config.liveness_interval_sec,
        )
        await self._conn.respond(msg, envelope.pack_ok(encode_model(record), self.registrar_id))

    # -- message handlers -------------------------------------------------------------

    def _spawning(self, handler: MessageHandler, *, counted: bool = False) -> MessageHandler:
        # Each message is handled in its own task so one slow announce (which may probe)
        # never holds up heartbeats; errors are logged, never raised into nats-py.
        # ``counted``: the tasks in flight make the backlog (``RegistrarConfig.max_backlog``)
        async def run(msg: Message) -> None:
            try:
                await handler(msg)
            except ReachError as exc:
                # NATS busy or away (a KV write timed out): one line, the sender retries;
                # a traceback per message would only add load when load is the problem
                log.warning("registrar could not handle %s: %s", msg.subject, exc)
            except Exception:
                log.exception("registrar failed on %s", msg.subject)

        def handled(task: asyncio.Task[None]) -> None:
            self._tasks.discard(task)
            self._handling -= 1

        async def dispatch(msg: Message) -> None:
            if self._stopping:
                return
            task = asyncio.create_task(run(msg))
            self._tasks.add(task)
            if counted:
                self._handling += 1
                task.add_done_callback(handled)
            else:
                task.add_done_callback(self._tasks.discard)

        return dispatch

    async def _reply_bad_message(self, msg: Message, exc: ReachError) -> None:
        if isinstance(exc, _Denied):
            self.denials += 1
            log.warning("denied %s: %s (%s)", msg.subject, exc, exc.code)
            if self._audit is not None:
                self._audit.record(
                    denial_event(
                        side="registrar",
                        ts=self._clock.time(),
                        capability=REGISTRY_CAPABILITY,
                        callee=subjects.last_token(msg.subject),
                        call_id=exc.call_id,
                        code=exc.code,
                        description=f"{msg.subject}: {exc}",
                        caller=exc.client_id,
                    )
                )
            if msg.reply:
                await self._conn.respond(
                    msg, envelope.pack_error("denied", exc.code, str(exc), self.registrar_id)
                )
            return
        log.warning("dropped malformed message on %s: %s", msg.subject, exc)
        if msg.reply:
            await self._conn.respond(
                msg, envelope.pack_error("contract", "invalid_message", str(exc), self.registrar_id)
            )

    def _decode(self, cls: type[_M], msg: Message) -> _M:
        return self._decode_with_claims(cls, msg)[0]

    def _decode_with_claims(self, cls: type[_M], msg: Message) -> tuple[_M, Claims | None]:
        meta, body = envelope.unpack_request(msg.data, self.config.max_message_bytes)
        claims = None
        if self._security.verifier is not None:
            # before the body is decoded: only a token bound to this agent_id may speak for it
            claims = self._authorize(meta, subjects.last_token(msg.subject))
        return decode_model(cls, body, self._limits), claims

    async def _check_mandate(self, claims: Claims | None, manifest: Manifest) -> None:
        """_Denied unless the client may serve what ``manifest`` offers: an agent
        credential serves the capabilities it lists (``reach creds add --cap``) and no
        others; one that lists none serves none. Only admins (and the registrar) may
        announce anything. NATS permissions hold the same line on the subscription side."""
        if claims is None or claims.has_role(ROLE_REGISTRAR) or claims.has_role(ROLE_ADMIN):
            return
        if self._credentials is None:
            self._credentials = await CredentialStore.open(self._conn, create=False)
        record = await self._credentials.get(claims.client_id)
        allowed = set(record.capabilities) if record is not None and not record.revoked else set()
        extra = sorted({c.name for c in manifest.capabilities} - allowed)
        if extra:
            may = ", ".join(sorted(allowed)) or "no capability (reach creds add --cap NAME)"
            raise _Denied(
                "capability_not_allowed",
                f"client {claims.client_id} may serve {may}; not {', '.join(extra)}",
                client_id=claims.client_id,
            )

    def _authorize(self, meta: envelope.RequestMeta, agent_id: str) -> Claims:
        assert self._security.verifier is not None
        if meta.token is None:
            raise _Denied(
                "no_token", f"a token is required to speak for {agent_id}", call_id=meta.call_id
            )
        try:
            claims = self._security.verifier.verify(meta.token)
        except AuthenticationFailed as exc:
            raise _Denied("authentication_failed", str(exc), call_id=meta.call_id) from None
        # operators and the local dev credential (admin) may speak for any agent
        if claims.agent_id != agent_id and not (
            claims.has_role(ROLE_REGISTRAR) or claims.has_role(ROLE_ADMIN)
        ):
            raise _Denied(
                "wrong_agent",
                f"client {claims.client_id} is bound to agent_id {claims.agent_id!r},"
                f" not {agent_id!r}",
                call_id=meta.call_id,
                client_id=claims.client_id,
            )
        return claims

    async def _on_announce(self, msg: Message) -> None:
        failure: ReachError | None = None
        try:
            req, claims = self._decode_with_claims(AnnounceRequest, msg)
            await self._check_mandate(claims, req.manifest)
        except (CodecError, ContractError, _Denied) as exc:
            failure = exc
        if failure is not None:
            await self._reply_bad_message(msg, failure)
            return
        agent_id = req.manifest.agent_id
        if subjects.last_token(msg.subject) != agent_id:
            reply = AnnounceReply(
                accepted=False,
                agent_id=agent_id,
                reason=f"announced on {msg.subject} but the manifest says agent_id {agent_id!r}",
                registrar_id=self.registrar_id,
            )
        else:
            reply = await self._register(req)
        await self._conn.respond(msg, envelope.pack_ok(encode_model(reply), self.registrar_id))

    async def _register(self, req: AnnounceRequest) -> AnnounceReply:
        agent_id = req.manifest.agent_id
        now = self._clock.time()
        fresh = self._new_instance(req, now)
        for _ in range(_CAS_ATTEMPTS):
            current = self._records.get(agent_id) or await self.store.get(agent_id)
            try:
                if current is None:
                    self._remember(fresh, await self.store.create(fresh))
                    log.info("registered %s (%s)", agent_id, req.instance_id)
                    return self._accepted(agent_id)
                inst, rev = current
                if inst.instance_id == req.instance_id:
                    # the same process announcing again (after a reconnect or an eviction)
                    renewed = fresh.model_copy(update={"registered_at": inst.registered_at})
                    self._remember(renewed, await self.store.update(renewed, rev))
                    return self._accepted(agent_id)
                live_reason = await self._still_live(inst, now)
                if live_reason:
                    return AnnounceReply(
                        accepted=False,
                        agent_id=agent_id,
                        registrar_id=self.registrar_id,
                        reason=(
                            f"agent_id {agent_id!r} is already live (instance {inst.instance_id},"
                            f" {live_reason}); a live agent_id is never shared: give this"
                            " instance its own agent_id"
                        ),
                    )
                replaced = fresh.model_copy(
                    update={
                        "transitions": self._with_transition(
                            inst.transitions,
                            Transition(
                                at=now,
                                status=fresh.status,
                                reason=f"replaced dead instance {inst.instance_id}",
                            ),
                        )
                    }
                )
                self._remember(replaced, await self.store.update(replaced, rev))
                log.info("replaced dead %s (%s → %s)", agent_id, inst.instance_id, req.instance_id)
                return self._accepted(agent_id)
            except KVConflict:
                await self._reload(agent_id)
        return AnnounceReply(
            accepted=False,
            agent_id=agent_id,
            registrar_id=self.registrar_id,
            reason="the registry record kept changing under concurrent writes; announce again",
        )

    def _accepted(self, agent_id: str) -> AnnounceReply:
        return AnnounceReply(accepted=True, agent_id=agent_id, registrar_id=self.registrar_id)

    def _new_instance(self, req: AnnounceRequest, now: float) -> Instance:
        status: HealthStatus = "healthy" if req.readiness.ready else "degraded"
        reason = "announced" if req.readiness.ready else f"not ready: {req.readiness.reason}"
        return Instance(
            manifest=req.manifest,
            instance_id=req.instance_id,
            status=status,
            status_reason=reason,
            registered_at=now,
            last_heartbeat_at=now,
            max_concurrency=req.manifest.max_concurrency,
            readiness=req.readiness,
            registrar_id=self.registrar_id,
            transitions=[Transition(at=now, status=status, reason=reason)],
            features=req.features,
        )

    async def _still_live(self, inst: Instance, now: float) -> str:
        """Why the registered instance counts as live, or "" if it is dead and may be replaced."""
        if now - inst.registered_at < self.config.duplicate_grace_sec:
            return f"registered {now - inst.registered_at:.1f}s ago"
        if (await probe(self._conn, inst, limits=self._limits)).ok:
            return "it answered a probe just now"
        return ""

    async def _on_heartbeat(self, msg: Message) -> None:
        try:
            hb = self._decode(Heartbeat, msg)
        except (CodecError, ContractError, _Denied) as exc:
            await self._reply_bad_message(msg, exc)
            return
        try:
            reply = await self._heartbeat(hb, subjects.last_token(msg.subject))
        except ReachError as exc:
            # it is alive, the registry could not take it (a JetStream leader election):
            # its silence is not counted from the record's older heartbeat
            if hb.agent_id in self._records:
                self._unrecorded[hb.agent_id] = self._clock.time()
            if msg.reply:  # told, not left to time out
                await self._conn.respond(
                    msg,
                    envelope.pack_error("unavailable", "not_recorded", str(exc), self.registrar_id),
                )
            raise
        if msg.reply:
            await self._conn.respond(msg, envelope.pack_ok(encode_model(reply), self.registrar_id))

    async def _heartbeat(self, hb: Heartbeat, subject_id: str) -> HeartbeatReply:
        if hb.agent_id != subject_id:
            return HeartbeatReply(ok=False, reason=f"heartbeat for {hb.agent_id} on {subject_id}")
        current = self._records.get(hb.agent_id)
        if current is None:
            return HeartbeatReply(ok=False, reannounce=True, reason="not registered")
        if current[0].instance_id != hb.instance_id:
            return HeartbeatReply(
                ok=False,
                reason=f"agent_id {hb.agent_id} belongs to instance {current[0].instance_id}",
            )
        now = self._clock.time()

        probed = self._probed.get(hb.agent_id)

        def apply(inst: Instance) -> Instance | None:
            if inst.instance_id != hb.instance_id:
                return None
            update: dict[str, Any] = {
                "last_heartbeat_at": now,
                "in_flight": hb.in_flight,
                "max_concurrency": hb.max_concurrency,
                "completed": hb.completed,
                "last_completion_at": hb.last_completion_at,
                "memory_bytes": hb.memory_bytes,
                "readiness": hb.readiness,
            }
            if probed is not None and probed[0] > (inst.last_probe_at or 0.0):
                update["last_probe_at"], update["last_probe_ms"] = probed
            updated = inst.model_copy(update=update)
            if inst.consecutive_failures >= inst.manifest.health.failures_before_unhealthy:
                # its probes fail: a heartbeat says the process lives, not that it answers
                # (only a probe that succeeds clears that, else health would flap)
                return updated
            return self._with_status(updated, *self._status_from(hb.readiness, "heartbeat"), now)

        result = await self._mutate(hb.agent_id, apply)
        if result is None:
            return HeartbeatReply(ok=False, reannounce=True, reason="not registered")
        if probed is not None and self._probed.get(hb.agent_id) == probed:
            del self._probed[hb.agent_id]
        return HeartbeatReply(ok=True)

    async def _on_bye(self, msg: Message) -> None:
        try:
            bye = self._decode(Bye, msg)
        except (CodecError, ContractError, _Denied) as exc:
            await self._reply_bad_message(msg, exc)
            return
        ok = False
        if subjects.last_token(msg.subject) == bye.agent_id:
            ok = await self._remove(bye.agent_id, bye.instance_id, f"deregistered: {bye.reason}")
        if msg.reply:
            reply = HeartbeatReply(ok=ok, reason="" if ok else "no such instance")
            await self._conn.respond(msg, envelope.pack_ok(encode_model(reply), self.registrar_id))

    # -- health ----------------------------------------------------------------------

    @staticmethod
    def _status_from(readiness: Readiness, source: str) -> tuple[HealthStatus, str]:
        if readiness.ready:
            return "healthy", f"{source} ok"
        return "degraded", f"not ready: {readiness.reason or 'readiness check failed'}"

    def _with_transition(self, transitions: list[Transition], new: Transition) -> list[Transition]:
        return [*transitions, new][-self.config.transitions_kept :]

    def _with_status(
        self, inst: Instance, status: HealthStatus, reason: str, now: float
    ) -> Instance:
        if inst.status == status:
            return inst
        reason = clip_reason(reason)
        log.info("%s: %s → %s (%s)", inst.agent_id, inst.status, status, reason)
        return inst.model_copy(
            update={
                "status": status,
                "status_reason": reason,
                "transitions": self._with_transition(
                    inst.transitions, Transition(at=now, status=status, reason=reason)
                ),
            }
        )

    async def _probe_and_record(self, inst: Instance) -> None:
        agent_id = inst.agent_id
        try:
            async with self._probe_slots:
                result = await probe(self._conn, inst, limits=self._limits)
            now = self._clock.time()

            def apply(cur: Instance) -> Instance | None:
                if cur.instance_id != inst.instance_id:
                    return None
                if result.reply is not None:
                    status, reason = self._status_from(result.reply.readiness, "probe")
                    if cur.status == status and cur.consecutive_failures == 0:
                        # nothing changed: no KV write; the next heartbeat records it
                        self._probed[agent_id] = (now, result.latency_ms)
                        return None
                    updated = cur.model_copy(
                        update={
                            "consecutive_failures": 0,
                            "last_probe_at": now,
                            "last_probe_ms": result.latency_ms,
                            "readiness": result.reply.readiness,
                            "in_flight": result.reply.in_flight,
                        }
                    )
                    return self._with_status(updated, status, reason, now)
                if self._settling(cur, now, result):
                    return None
                failures = cur.consecutive_failures + 1
                updated = cur.model_copy(
                    update={"consecutive_failures": failures, "last_probe_at": now}
                )
                if failures >= cur.manifest.health.failures_before_unhealthy:
                    reason = f"{failures} consecutive probe failures, last: {result.reason}"
                    return self._with_status(updated, "unhealthy", reason, now)
                return updated

            await self._mutate(agent_id, apply)
        except ReachError as exc:  # NATS busy or away: the next probe tries again
            log.warning("could not record the probe of %s: %s", agent_id, exc)
        except Exception:
            log.exception("probing %s failed", agent_id)
        finally:
            self._probing.discard(agent_id)

    # -- loops -----------------------------------------------------------------------

    async def _watch_loop(self) -> None:
        while not self._stopping:
            try:
                async for change in self.store.watch():
                    if change is None:
                        self._synced.set()
                    elif change.key.startswith(subjects.REGISTRAR_KEY_PREFIX):
                        rid = change.key[len(subjects.REGISTRAR_KEY_PREFIX) :]
                        if change.registrar is not None:
                            if rid not in self._registrars:
                                self._owner_cache.clear()
                            self._registrars[rid] = change.registrar
                        elif self._registrars.pop(rid, None) is not None:
                            self._owner_cache.clear()
                    elif change.instance is not None:
                        self._remember(change.instance, change.revision)
                        if self._alerts is not None:
                            self._alerts.registry_changed(change.agent_id, change.instance)
                    elif change.deleted:
                        self._forget(change.agent_id, change.revision)
                        if self._alerts is not None:
                            self._alerts.registry_changed(change.agent_id, None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._trouble()
                log.warning("registry watch failed (%s); restarting", exc)
                await asyncio.sleep(0.5)

    def _remember(self, inst: Instance, revision: int) -> None:
        current = self._records.get(inst.agent_id)
        if current is None or current[1] < revision:
            self._records[inst.agent_id] = (inst, revision)

    def _forget(self, agent_id: str, revision: int) -> None:
        current = self._records.get(agent_id)
        if current is not None and current[1] < revision:
            del self._records[agent_id]
            self._last_probe.pop(agent_id, None)
            self._probed.pop(agent_id, None)
            self._unrecorded.pop(agent_id, None)
            self._owner_cache.pop(agent_id, None)

    async def _reload(self, agent_id: str) -> None:
        fresh = await self.store.get(agent_id)
        if fresh is None:
            self._records.pop(agent_id, None)
        else:
            self._remember(*fresh)

    async def _mutate(
        self, agent_id: str, change: Callable[[Instance], Instance | None]
    ) -> Instance | None:
        """Apply ``change`` to the record with compare-and-set, re-reading on conflict."""
        for _ in range(_CAS_ATTEMPTS):
            current = self._records.get(agent_id)
            if current is None:
                return None
            inst, rev = current
            updated = change(inst)
            if updated is None or updated is inst:
                return inst
            try:
                self._remember(updated, await self.store.update(updated, rev))
                return updated
            except KVConflict:
                await self._reload(agent_id)
        log.warning("gave up updating %s after %d conflicts", agent_id, _CAS_ATTEMPTS)
        return None

    async def _remove(
        self,
        agent_id: str,
        instance_id: str | None,
        reason: str,
        still: Callable[[Instance], bool] | None = None,
    ) -> bool:
        """Delete the record (of ``instance_id`` if given) with compare-and-set; after a
        conflict the fresh record is checked again, and kept unless ``still(record)``."""
        for _ in range(_CAS_ATTEMPTS):
            current = self._records.get(agent_id)
            if current is None or (instance_id and current[0].instance_id != instance_id):
                return False
            if still is not None and not still(current[0]):
                return False
            try:
                await self.store.delete(agent_id, last=current[1])
            except KVConflict:
                await self._reload(agent_id)
                continue
            self._records.pop(agent_id, None)
            self._last_probe.pop(agent_id, None)
            self._probed.pop(agent_id, None)
            self._unrecorded.pop(agent_id, None)
            log.info("removed %s: %s", agent_id, reason)
            return True
        return False

    def _silence(self, inst: Instance, now: float) -> float:
        """How long the instance has not been heard from, as far as this registrar knows:
        since its last recorded heartbeat, but never counting time before this registrar
        started or before it last had trouble keeping the registry current."""
        heard = max(inst.last_heartbeat_at, self._unrecorded.get(inst.agent_id, 0.0))
        return now - max(heard, self._started_at, self._trouble_at)

    def _settling(self, inst: Instance, now: float, result: ProbeResult) -> bool:
        """A probe nobody received, soon after this registrar's own trouble (its connection
        back after a server restart, say) or start: the instance may not have reconnected yet,
        which its heartbeats will show, as they do when they stop. Not a failure until
        the instance has had the time a silence would be given."""
        if not isinstance(result.error, NoResponders):
            return False
        health = inst.manifest.health
        since = max(self._trouble_at, self._started_at)
        return now - since < health.interval_sec * health.failures_before_unhealthy

    def _trouble(self) -> None:
        self._trouble_at = self._clock.time()

    def _owns(self, agent_id: str) -> bool:
        cached = self._owner_cache.get(agent_id)
        if cached is not None:
            return cached
        now = self._clock.time()
        live = [self.registrar_id] + [
            rid
            for rid, rec in self._registrars.items()
            if rid != self.registrar_id and now - rec.seen_at < 3 * rec.interval_sec
        ]
        owner = max(live, key=lambda rid: hashlib.blake2b(f"{rid}/{agent_id}".encode()).digest())
        mine = owner == self.registrar_id
        self._owner_cache[agent_id] = mine
        return mine

    async def _refresh_liveness(self) -> None:
        now = self._clock.time()
        await self.store.put_registrar(
            RegistrarRecord(
                registrar_id=self.registrar_id,
                started_at=self._started_at,
                seen_at=now,
                interval_sec=self.config.liveness_interval_sec,
            )
        )
        # a registrar that stopped refreshing drops out of ownership
        stale = [
            rid
            for rid, rec in self._registrars.items()
            if rid != self.registrar_id and now - rec.seen_at >= 3 * rec.interval_sec
        ]
        if stale:
            self._owner_cache.clear()

    async def _liveness_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.config.liveness_interval_sec)
            try:
                await self._refresh_liveness()
            except ReachError as exc:
                log.warning("could not refresh registrar liveness: %s", exc)

    async def _sweep_loop(self) -> None:
        while not self._stopping:
            tick = 1.0
            try:
                tick = await self._sweep()
            except ReachError as exc:
                self._trouble()
                log.warning("sweep failed: %s", exc)
            await asyncio.sleep(tick)

    async def _sweep(self) -> float:
        """One pass over owned records: evict the silent, mark missed heartbeats, start probes."""
        now = self._clock.time()
        tick = 1.0
        if self._handling > self.config.max_backlog:
            if now - self._trouble_at > 10.0:
                log.warning(
                    "registrar behind: %d messages being handled; no eviction until caught up",
                    self._handling,
                )
            self._trouble()
        for agent_id, (inst, _) in list(self._records.items()):
            health = inst.manifest.health
            tick = min(tick, health.interval_sec / 4)
            if not self._owns(agent_id):
                continue
            silence = self._silence(inst, now)
            evict_after = self.config.evict_after_intervals * health.interval_sec
            if silence >= evict_after:
                # checked again on the record as it is now if it changed meanwhile (a
                # heartbeat another registrar wrote, which this one's watch has not shown)
                def silent(cur: Instance, limit: float = evict_after) -> bool:
                    return self._silence(cur, now) >= limit

                await self._remove(
                    agent_id, inst.instance_id, f"silent for {silence:.1f}s: evicted", silent
                )
                continue
            missed = int(silence / health.interval_sec)
            if missed >= health.failures_before_unhealthy and inst.status != "unhealthy":
                reason = f"missed {missed} heartbeats ({silence:.1f}s silent)"

                def mark(cur: Instance, reason: str = reason) -> Instance | None:
                    cur_health = cur.manifest.health
                    quiet = cur_health.interval_sec * cur_health.failures_before_unhealthy
                    if self._silence(cur, now) < quiet:
                        return cur  # a heartbeat came in meanwhile
                    return self._with_status(cur, "unhealthy", reason, now)

                await self._mutate(agent_id, mark)
            probe_every = health.interval_sec
            if inst.age(now) < self.config.new_agent_window_sec:
                probe_every /= 2
            last = self._last_probe.get(agent_id, inst.registered_at)
            if agent_id not in self._probing and now - last >= probe_every:
                self._probing.add(agent_id)
                self._last_probe[agent_id] = now
                task = asyncio.create_task(self._probe_and_record(inst))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        return max(0.02, tick)
