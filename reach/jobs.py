"""Async-mode capabilities: a call becomes a job whose result is kept in JetStream.

The callee writes the job record to the KV bucket REACH_JOBS (key ``job.<job_id>``, the
job id naming the client that called and the agent that runs it: ``new_job_id``)
when it accepts the call and again when the handler finishes; the bucket's TTL is the
retention time. A caller holds a ``JobHandle`` and can wait for the result, also after
a restart: ``client.job(job_id)``.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from reach import codec, subjects
from reach.errors import (
    BusinessError,
    ContractError,
    InternalError,
    NotFound,
    ReachError,
    ReachTimeout,
    Unavailable,
)
from reach.messages import decode_model
from reach.transport import Connection, KVBucket

__all__ = ["JOB_RETENTION_SEC", "ClientJobs", "JobHandle", "JobRecord", "JobStore", "new_job_id"]

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
