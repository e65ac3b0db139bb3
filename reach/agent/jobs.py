"""Async-mode capabilities: a call becomes a job whose result is kept in JetStream.

The callee writes the job record to the KV bucket REACH_JOBS (key ``job.<job_id>``, the
job id naming the client that called and the agent that runs it: ``new_job_id``)
when it accepts the call and again when the handler finishes; the bucket's TTL is the
retention time. A caller holds a ``JobHandle`` and can wait for the result, also after
a restart: ``client.job(job_id)``.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from reach.agent.endpoint import Endpoint, Failure
from reach.clock import Clock
from reach.deadline import Deadline
from reach.errors import (
    BusinessError,
    CodecError,
    ConfigurationError,
    ContractError,
    InternalError,
    NotFound,
    ReachError,
    ReachTimeout,
    Unavailable,
)
from reach.tasks import EAGER
from reach.transport import Connection, KVBucket
from reach.wire import codec, envelope, subjects
from reach.wire.modelcodec import decode_model

__all__ = [
    "JOB_RETENTION_SEC",
    "ClientJobs",
    "Invoke",
    "JobHandle",
    "JobRecord",
    "JobRunner",
    "JobStore",
    "new_job_id",
]

log = logging.getLogger("reach.agent.jobs")

#: how long job records (and results) are kept
JOB_RETENTION_SEC = 24 * 3600.0

JobStatus = Literal["accepted", "running", "succeeded", "failed"]


class JobRecord(BaseModel):
    """A job in REACH_JOBS."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str
    capability: str
    agent_id: str
    status: JobStatus
    accepted_at: float
    finished_at: float | None = None
    result: Any = None
    error_kind: str = ""
    error_code: str = ""
    error: str = ""
    call_id: str = Field("", description="the call that created the job")

    @property
    def done(self) -> bool:
        return self.status in ("succeeded", "failed")

    def error_value(self) -> ReachError:
        """The typed error of a failed job."""
        if self.error_kind == "business":
            return BusinessError(self.error, code=self.error_code, agent_id=self.agent_id)
        if self.error_kind == "contract":
            return ContractError(f"{self.error} (job {self.job_id})", rule=self.error_code)
        if self.error_kind == "timeout":
            return ReachTimeout(f"job {self.job_id}: {self.error}")
        if self.error_kind == "unavailable":
            return Unavailable(f"job {self.job_id}: {self.error}")
        return InternalError(self.error, code=self.error_code, agent_id=self.agent_id)


def _key(job_id: str) -> str:
    return f"job.{job_id}"


def new_job_id(client_id: str, agent_id: str) -> str:
    """The id of a job ``agent_id`` runs for ``client_id``: ``<client_id>.<agent_id>.<random>``.

    Its record's key, ``job.<job_id>``, names both, which is how NATS permissions keep a
    job's result to the two of them: a client may read only keys under
    ``job.<its client_id>.``, an agent write only keys with its own agent id second."""
    return f"{client_id or subjects.ANONYMOUS}.{agent_id}.{secrets.token_hex(12)}"


class JobStore:
    """Typed access to REACH_JOBS."""

    def __init__(self, bucket: KVBucket) -> None:
        self.bucket = bucket

    @classmethod
    async def open(
        cls,
        conn: Connection,
        *,
        create: bool = False,
        replicas: int = 1,
        retention_sec: float = JOB_RETENTION_SEC,
    ) -> JobStore:
        bucket = await conn.key_value(
            subjects.JOBS_BUCKET,
            create=create,
            replicas=replicas,
            ttl=retention_sec,
            public=True,
            # a key's value by a request that names the key: all a client may read is its
            # own jobs' keys, and the leader's get names the key only in its body
            direct_gets=True,
        )
        return cls(bucket)

    async def put(self, record: JobRecord) -> None:
        # python mode: the result goes as the handler returned it, like a reply (bytes
        # stay bytes, a NaN stays a NaN), and what cannot travel raises a CodecError
        await self.bucket.put(_key(record.job_id), codec.encode(record.model_dump()))

    async def get(self, job_id: str) -> JobRecord | None:
        entry = await self.bucket.get(_key(job_id))
        if entry is None or not entry.value:
            return None
        return decode_model(JobRecord, entry.value)

    async def wait(self, job_id: str) -> JobRecord:
        """The job's record once it is done (watches the key; no polling)."""
        async for entry in self.bucket.watch(_key(job_id)):
            if entry is None or entry.deleted or not entry.value:
                continue
            record = decode_model(JobRecord, entry.value)
            if record.done:
                return record
        raise NotFound(f"job {job_id} disappeared")  # pragma: no cover - watch ended


class JobHandle:
    """A job accepted by an async-mode agent."""

    def __init__(self, store: JobStore, job_id: str, capability: str, agent_id: str) -> None:
        self._store = store
        self.job_id = job_id
        self.capability = capability
        self.agent_id = agent_id

    def __repr__(self) -> str:
        return f"JobHandle({self.job_id!r}, capability={self.capability!r})"

    async def status(self) -> JobRecord:
        record = await self._store.get(self.job_id)
        if record is None:
            raise NotFound(f"job {self.job_id} is unknown (or past its retention time)")
        return record

    async def result(self, timeout: float | None = None) -> Any:
        """The job's result; raises the job's typed error, or ReachTimeout after ``timeout``."""
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                record = await self._store.wait(self.job_id)
        except TimeoutError:
            raise ReachTimeout(
                f"job {self.job_id} not done after {time.monotonic() - started:.1f}s"
            ) from None
        if record.status == "failed":
            raise record.error_value()
        return record.result


class ClientJobs:
    """A caller's way to its jobs: REACH_JOBS opened on first use, over the client's
    connection (``conn``, set once it is connected)."""

    def __init__(self) -> None:
        self.conn: Connection | None = None
        self._store: JobStore | None = None

    async def store(self) -> JobStore:
        store = self._store
        if store is None:
            if self.conn is None:
                raise RuntimeError(
                    "connect the client first: `async with ReachClient() as client:`"
                )
            store = self._store = await JobStore.open(self.conn)
        return store

    async def handle(self, job_id: str) -> JobHandle:
        """A handle on an earlier job, also from another process or after a restart."""
        store = await self.store()
        record = await store.get(job_id)
        if record is None:
            raise NotFound(f"job {job_id} is unknown (or past its retention time)")
        return JobHandle(store, job_id, record.capability, record.agent_id)

    def forget(self) -> None:
        """The connection closed: the store goes with it."""
        self.conn = None
        self._store = None


#: a handler run under a deadline: the encoded and plain result, or a Failure
Invoke = Callable[
    [Endpoint, envelope.RequestMeta, Any, Deadline | None], Awaitable[tuple[bytes, Any] | Failure]
]


class JobRunner:
    """Async-mode calls as the callee runs them: the job recorded as accepted, its id the
    reply, the handler run in the background and its outcome recorded."""

    def __init__(self, agent_id: str, clock: Clock, invoke: Invoke) -> None:
        self.agent_id = agent_id
        self._clock = clock
        self._invoke = invoke
        self._running: set[asyncio.Task[None]] = set()

    async def accept(
        self,
        store: JobStore,
        endpoint: Endpoint,
        meta: envelope.RequestMeta,
        arg: Any,
        client: str,
        timeout_sec: float,
    ) -> bytes:
        """Record the job durably, reply with its id, run it in the background for at most
        ``timeout_sec`` (10 × the capability's SLA, if longer)."""
        job_id = new_job_id(client, self.agent_id)
        record = JobRecord(
            job_id=job_id,
            capability=endpoint.name,
            agent_id=self.agent_id,
            status="accepted",
            accepted_at=self._clock.time(),
            call_id=meta.call_id,
        )
        await store.put(record)
        # a context of its own: the job must not inherit an eager step's state
        context = contextvars.copy_context()
        context.run(EAGER.set, False)
        limit = max(timeout_sec, 10 * endpoint.capability.latency_sla_ms / 1000)
        task = asyncio.create_task(
            self._run(store, endpoint, meta, arg, record, limit), context=context
        )
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        body = codec.encode({"job_id": job_id}, checked=False)
        return envelope.pack_ok(body, self.agent_id, job=job_id)

    async def _run(
        self,
        store: JobStore,
        endpoint: Endpoint,
        meta: envelope.RequestMeta,
        arg: Any,
        record: JobRecord,
        limit: float,
    ) -> None:
        outcome = await self._invoke(endpoint, meta, arg, Deadline.after(limit, self._clock))
        finished = self._clock.time()
        if isinstance(outcome, Failure):
            done = _failed(record, finished, outcome.kind, outcome.code, outcome.description)
        else:
            done = record.model_copy(
                update={"status": "succeeded", "finished_at": finished, "result": outcome[1]}
            )
        try:
            await store.put(done)
            return
        except (CodecError, ConfigurationError) as exc:  # a result too large to be kept
            log.error("the result of job %s cannot be stored: %s", record.job_id, exc)
            kind, code, why = "contract", "output", f"the result cannot be stored: {exc}"
        except ReachError as exc:
            log.error("could not store the result of job %s: %s", record.job_id, exc)
            return
        except Exception as exc:  # a bug: said in the record, not left "accepted" for ever
            log.exception("could not store the result of job %s", record.job_id)
            kind, code, why = "internal", type(exc).__name__, f"the result cannot be stored: {exc}"
        try:
            await store.put(_failed(record, finished, kind, code, why))
        except ReachError as exc:
            log.error("could not store the failure of job %s: %s", record.job_id, exc)


def _failed(record: JobRecord, finished: float, kind: str, code: str, why: str) -> JobRecord:
    return record.model_copy(
        update={
            "status": "failed",
            "finished_at": finished,
            "error_kind": kind,
            "error_code": code,
            "error": why,
        }
    )
