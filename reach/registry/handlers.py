"""The registrar's answers to announces, heartbeats and byes (``reach.v1.announce.*``,
``reach.v1.heartbeat.*``, ``reach.v1.bye.*``).

Each message is checked (:mod:`reach.registry.message_auth`), turned into a change of the
instance's record by the health policy (:mod:`reach.registry.health`) and written with
compare-and-set (:mod:`reach.registry.instances`). A live agent_id is never shared: an
announce of another instance replaces the record only once its instance is dead. No
record serves a capability above the clearance of the token that speaks for it: such an
announce is refused, and a record that does (one written before announces were checked
for it) is removed at its next heartbeat.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from reach.audit.events import REGISTRY_CAPABILITY, denial_event
from reach.audit.writer import AuditWriter
from reach.clock import Clock
from reach.errors import CodecError, ContractError, ReachError
from reach.registry.controlbudget import ControlBudget
from reach.registry.health import HealthPolicy, UnwrittenProbe
from reach.registry.instances import CAS_ATTEMPTS, RecordView
from reach.registry.message_auth import Denied, MessageAuth, above_clearance
from reach.registry.probes import probe
from reach.security.refusals import RefusalLog
from reach.security.tokens import Claims
from reach.transport import Connection, KVConflict, Message
from reach.wire import envelope, subjects
from reach.wire.codec import Limits
from reach.wire.modelcodec import encode_model
from reach.wire.models import (
    AnnounceReply,
    AnnounceRequest,
    Bye,
    Heartbeat,
    HeartbeatReply,
    Instance,
    Transition,
)

__all__ = ["ControlHandlers", "MessageHandler"]

log = logging.getLogger("reach.registrar")

MessageHandler = Callable[[Message], Coroutine[Any, Any, None]]


class ControlHandlers:
    """Handles the control messages of agents for one registrar."""

    def __init__(
        self,
        conn: Connection,
        registrar_id: str,
        *,
        view: RecordView,
        policy: HealthPolicy,
        auth: MessageAuth,
        limits: Limits,
        duplicate_grace_sec: float,
    ) -> None:
        self._conn = conn
        self.registrar_id = registrar_id
        self._view = view
        self._policy = policy
        self._auth = auth
        self._limits = limits
        self._duplicate_grace_sec = duplicate_grace_sec
        self._clock: Clock = policy.clock
        #: where denials are audited, once the registrar has started its writer
        self.audit: AuditWriter | None = None
        #: control messages refused for their token or mandate
        self.denials = 0
        #: heartbeats being handled now (see ``RegistrarConfig.max_backlog``)
        self.handling = 0
        #: set when the registrar stops: messages then arriving are dropped
        self.stopping = False
        self.tasks: set[asyncio.Task[None]] = set()
        #: how many control messages each agent id may send (see :mod:`~.budget`)
        self.budget = ControlBudget(self._clock)
        #: messages dropped or refused: a few lines, then a summary per interval
        self.refusals = RefusalLog(log, "control messages", who="agent ids", clock=self._clock)
        #: the answer to a heartbeat taken: the same bytes every time
        self._heartbeat_ok = envelope.pack_ok(encode_model(HeartbeatReply(ok=True)), registrar_id)
        #: the answer to a control message over its sender's budget
        self._too_many = envelope.pack_error(
            "unavailable",
            "too_many",
            "more control messages from this agent_id than its health interval needs;"
            " dropped unread",
            registrar_id,
        )
        self._reply = conn.replier(with_turn=True)

    def spawning(self, handler: MessageHandler) -> MessageHandler:
        """``handler`` run in a task of its own per message, so one slow announce (which
        may probe) never holds up heartbeats; errors are logged, never raised into the
        client library."""

        async def dispatch(msg: Message) -> None:
            if self.stopping:
                return
            agent_id = subjects.last_token(msg.subject)
            if self._admitted(agent_id, self._view.get(agent_id), msg):
                self._spawn(handler(msg), msg.subject, counted=False)

        return dispatch

    def _spawn(self, work: Coroutine[Any, Any, None], subject: str, *, counted: bool) -> None:
        """Run ``work`` in a task; ``counted``: while it runs, it is part of the backlog.
        A task cancelled before it ran (the registrar stopping) closes ``work`` unrun."""

        async def run() -> None:
            try:
                await work
            except ReachError as exc:
                # NATS busy or away (a KV write timed out): one line, the sender retries;
                # a traceback per message would only add load when load is the problem
                log.warning("registrar could not handle %s: %s", subject, exc)
            except Exception:
                log.exception("registrar failed on %s", subject)

        task = asyncio.create_task(run())
        task.add_done_callback(lambda _task: work.close())  # (done or unrun: no-op or close)
        self.tasks.add(task)
        if counted:
            self.handling += 1
            task.add_done_callback(self._handled)
        else:
            task.add_done_callback(self.tasks.discard)

    def _admitted(self, agent_id: str, current: tuple[Instance, int] | None, msg: Message) -> bool:
        """Whether ``msg`` of ``agent_id`` (its record ``current``) is within the agent
        id's budget; if not it is dropped, answered ``too_many`` if it asks for an answer."""
        interval = current[0].manifest.health.interval_sec if current is not None else None
        if self.budget.take(agent_id, interval):
            return True
        self.refusals.refused(agent_id, "over its budget of control messages")
        if msg.reply:
            self._reply(msg.reply, self._too_many)
        return False

    def _handled(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self.handling -= 1

    async def _respond_ok(self, msg: Message, reply: AnnounceReply | HeartbeatReply) -> None:
        await self._conn.respond(msg, envelope.pack_ok(encode_model(reply), self.registrar_id))

    async def reply_bad_message(self, msg: Message, exc: ReachError) -> None:
        """Answer a message that was refused (:class:`Denied`, audited) or malformed."""
        if isinstance(exc, Denied):
            self.denials += 1
            self.refusals.refused(
                subjects.last_token(msg.subject), f"denied ({exc.code}) on {msg.subject}: {exc}"
            )
            if self.audit is not None:
                self.audit.record(
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
        self.refusals.refused(
            subjects.last_token(msg.subject), f"malformed on {msg.subject}: {exc}"
        )
        if msg.reply:
            await self._conn.respond(
                msg, envelope.pack_error("contract", "invalid_message", str(exc), self.registrar_id)
            )

    # -- announce ------------------------------------------------------------------------

    async def on_announce(self, msg: Message) -> None:
        failure: ReachError | None = None
        try:
            req, claims = self._auth.decode_with_claims(AnnounceRequest, msg)
            await self._auth.check_mandate(claims, req.manifest)
        except (CodecError, ContractError, Denied) as exc:
            failure = exc
        if failure is not None:
            await self.reply_bad_message(msg, failure)
            return
        agent_id = req.manifest.agent_id
        if subjects.last_token(msg.subject) != agent_id:
            reply = self._refused(
                agent_id, f"announced on {msg.subject} but the manifest says agent_id {agent_id!r}"
            )
        else:
            reply = await self._register(req)
        await self._respond_ok(msg, reply)

    async def _register(self, req: AnnounceRequest) -> AnnounceReply:
        agent_id = req.manifest.agent_id
        now = self._clock.time()
        fresh = self._new_instance(req, now)
        store = self._view.store
        for _ in range(CAS_ATTEMPTS):
            current = self._view.get(agent_id) or await store.get(agent_id)
            try:
                if current is None:
                    self._view.remember(fresh, await store.create(fresh))
                    log.info("registered %s (%s)", agent_id, req.instance_id)
                    return self._accepted(agent_id)
                inst, rev = current
                if inst.instance_id == req.instance_id:
                    # the same process announcing again (after a reconnect or an eviction)
                    renewed = fresh.model_copy(update={"registered_at": inst.registered_at})
                    self._view.remember(renewed, await store.update(renewed, rev))
                    return self._accepted(agent_id)
                live_reason = await self._still_live(inst, now)
                if live_reason:
                    return self._refused(
                        agent_id,
                        f"agent_id {agent_id!r} is already live (instance {inst.instance_id},"
                        f" {live_reason}); a live agent_id is never shared: give this"
                        " instance its own agent_id",
                    )
                replaced = self._replacing(fresh, inst, now)
                self._view.remember(replaced, await store.update(replaced, rev))
                log.info("replaced dead %s (%s → %s)", agent_id, inst.instance_id, req.instance_id)
                return self._accepted(agent_id)
            except KVConflict:
                await self._view.reload(agent_id)
        return self._refused(
            agent_id, "the registry record kept changing under concurrent writes; announce again"
        )

    def _accepted(self, agent_id: str) -> AnnounceReply:
        return AnnounceReply(accepted=True, agent_id=agent_id, registrar_id=self.registrar_id)

    def _refused(self, agent_id: str, reason: str) -> AnnounceReply:
        return AnnounceReply(
            accepted=False, agent_id=agent_id, reason=reason, registrar_id=self.registrar_id
        )

    def _new_instance(self, req: AnnounceRequest, now: float) -> Instance:
        status, reason = self._policy.announced(req.readiness)
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

    def _replacing(self, fresh: Instance, dead: Instance, now: float) -> Instance:
        """``fresh`` taking the record of ``dead``, whose transitions it keeps."""
        replaced = Transition(
            at=now, status=fresh.status, reason=f"replaced dead instance {dead.instance_id}"
        )
        return fresh.model_copy(
            update={"transitions": self._policy.with_transition(dead.transitions, replaced)}
        )

    async def _still_live(self, inst: Instance, now: float) -> str:
        """Why the registered instance counts as live, or "" if it is dead and may be replaced."""
        if now - inst.registered_at < self._duplicate_grace_sec:
            return f"registered {now - inst.registered_at:.1f}s ago"
        if (await probe(self._conn, inst, limits=self._limits, clock=self._clock)).ok:
            return "it answered a probe just now"
        return ""

    # -- heartbeat and bye ---------------------------------------------------------------

    def heartbeat(self, msg: Message) -> None:
        """Handle a heartbeat: at once when it writes nothing (most do: see
        :mod:`reach.registry.material`), in a task of its own (counted in ``handling``)
        when it must write or be refused."""
        if self.stopping:
            return
        subject_id = subjects.last_token(msg.subject)
        current = self._view.get(subject_id)
        if not self._admitted(subject_id, current, msg):
            return
        try:
            hb, claims = self._auth.decode_with_claims(Heartbeat, msg)
        except (CodecError, ContractError, Denied) as exc:
            self._spawn(self.reply_bad_message(msg, exc), msg.subject, counted=True)
            return
        if (
            claims is not None
            and current is not None
            and claims.level < current[0].manifest.highest_level
            and current[0].instance_id == hb.instance_id
            and hb.agent_id == subject_id
        ):
            work = self._refuse_above_clearance(msg, hb, claims, current[0])
            self._spawn(work, msg.subject, counted=True)
            return
        write = self._heartbeat_now(hb, subject_id, current)
        if write is None:
            if msg.reply:
                self._reply(msg.reply, self._heartbeat_ok)
            return
        self._spawn(self._answer_heartbeat(msg, write), msg.subject, counted=True)

    def _heartbeat_now(
        self, hb: Heartbeat, subject_id: str, current: tuple[Instance, int] | None
    ) -> Callable[[], Coroutine[Any, Any, HeartbeatReply]] | None:
        """None if heartbeat ``hb`` of a registered instance (its record ``current``, the
        one of ``subject_id``) was taken without a write (answered ok); else what answers
        it (a write, a refusal, a lookup in the store), to be called in the task that
        awaits it."""
        if hb.agent_id != subject_id or current is None or current[0].instance_id != hb.instance_id:
            return functools.partial(self._heartbeat, hb, subject_id)
        now = self._clock.time()
        policy = self._policy
        policy.heard(hb.agent_id, now)
        probed = policy.unwritten_probe(hb.agent_id)
        # asked here first (most heartbeats change nothing routing reads); the write asks
        # again on the record as it is then if it meets a conflict
        updated = policy.after_heartbeat(current[0], hb, now, probed)
        if updated is None or updated is current[0]:
            policy.probe_written(hb.agent_id, probed)
            return None
        change = functools.partial(_after_heartbeat, policy, hb, now, probed)
        write = self._view.write_of(hb.agent_id, current, updated, change)
        return functools.partial(self._written, hb.agent_id, write, probed)

    async def _written(
        self,
        agent_id: str,
        write: Callable[[], Coroutine[Any, Any, Instance | None]],
        probed: UnwrittenProbe | None,
    ) -> HeartbeatReply:
        if await write() is None:
            return HeartbeatReply(ok=False, reannounce=True, reason="not registered")
        self._policy.probe_written(agent_id, probed)
        return HeartbeatReply(ok=True)

    async def _refuse_above_clearance(
        self, msg: Message, hb: Heartbeat, claims: Claims, inst: Instance
    ) -> None:
        """A heartbeat keeping alive a record that serves above the clearance of its token
        (a record its announce could no longer write): the record is removed, so no call
        is routed there, and the heartbeat refused as its announce would be."""
        denied = above_clearance(claims, inst.manifest)
        assert denied is not None
        await self._view.remove(
            hb.agent_id,
            hb.instance_id,
            f"serves above its clearance: {denied}",
            still=lambda record: record.manifest.highest_level > claims.level,
        )
        await self.reply_bad_message(msg, denied)

    async def _answer_heartbeat(
        self, msg: Message, answer: Callable[[], Coroutine[Any, Any, HeartbeatReply]]
    ) -> None:
        try:
            reply = await answer()
        except ReachError as exc:
            # it is alive (heard, see _heartbeat), the registry could not take a change
            # (a JetStream leader election): the next heartbeat brings it again
            if msg.reply:  # told, not left to time out
                await self._conn.respond(
                    msg,
                    envelope.pack_error("unavailable", "not_recorded", str(exc), self.registrar_id),
                )
            raise
        if msg.reply:
            await self._respond_ok(msg, reply)

    async def _heartbeat(self, hb: Heartbeat, subject_id: str) -> HeartbeatReply:
        if hb.agent_id != subject_id:
            return HeartbeatReply(ok=False, reason=f"heartbeat for {hb.agent_id} on {subject_id}")
        current = self._view.get(hb.agent_id)
        if current is None:
            # announced through another registrar a moment ago, its watch not here yet?
            current = await self._view.store.get(hb.agent_id)
            if current is None:
                return HeartbeatReply(ok=False, reannounce=True, reason="not registered")
            self._view.remember(*current)
        if current[0].instance_id != hb.instance_id:
            return HeartbeatReply(
                ok=False,
                reason=f"agent_id {hb.agent_id} belongs to instance {current[0].instance_id}",
            )
        now = self._clock.time()
        policy = self._policy
        # heard: its silence counts from now, whether or not the record is written
        policy.heard(hb.agent_id, now)
        probed = policy.unwritten_probe(hb.agent_id)
        result = await self._view.mutate(
            hb.agent_id, functools.partial(_after_heartbeat, policy, hb, now, probed)
        )
        if result is None:
            return HeartbeatReply(ok=False, reannounce=True, reason="not registered")
        policy.probe_written(hb.agent_id, probed)
        return HeartbeatReply(ok=True)

    async def on_bye(self, msg: Message) -> None:
        try:
            bye = self._auth.decode(Bye, msg)
        except (CodecError, ContractError, Denied) as exc:
            await self.reply_bad_message(msg, exc)
            return
        ok = False
        if subjects.last_token(msg.subject) == bye.agent_id:
            ok = await self._view.remove(
                bye.agent_id, bye.instance_id, f"deregistered: {bye.reason}"
            )
        if msg.reply:
            await self._respond_ok(
                msg, HeartbeatReply(ok=ok, reason="" if ok else "no such instance")
            )


def _after_heartbeat(
    policy: HealthPolicy,
    hb: Heartbeat,
    now: float,
    probed: UnwrittenProbe | None,
    inst: Instance,
) -> Instance | None:
    return policy.after_heartbeat(inst, hb, now, probed)
