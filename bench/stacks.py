"""The stacks the call-path benchmark compares, and the registry a new stack joins.

A stack is two hooks around one echo of :data:`bench.payload.PAYLOAD`:

- ``responder(ctx)``: an async context manager run in its own OS process
  (``python -m bench.procs responder``); it serves until the context exits;
- ``caller(ctx)``: an async context manager run in the bench process; it yields
  ``call(payload) -> reply`` once the responder is reachable.

Adding a stack is one ``register(Stack(...))`` with those two hooks::

    @asynccontextmanager
    async def _my_responder(ctx: Context) -> AsyncIterator[None]: ...
    @asynccontextmanager
    async def _my_caller(ctx: Context) -> AsyncIterator[Call]: ...

    register(Stack("my-stack", "what it measures", _my_responder, _my_caller))

Stacks that announce agents set ``needs_registry=True``: the bench then runs a
registrar in a process of its own, as ``reach up`` would.

A *variant* (``variant_of="reach"``) measures another stack's responder and caller, the
same processes and connections, with one feature of the caller switched off while its
blocks run (``switch(ctx)``, around each block). Two processes that run the same code
are not equally fast (hash seeds, heap layouts): stacks of their own differ by a point or
two of calls/s for that alone, which a variant does not.

A stack whose framework is an optional install (``pip install -e '.[bench]'``) is
registered only when that framework imports; otherwise :data:`UNAVAILABLE` says why.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
    nullcontext,
)
from dataclasses import dataclass
from typing import Any

import msgpack
import nats
from nats.micro import add_service
from nats.micro.request import Request

from bench.payload import PAYLOAD_SCHEMA
from reach.agent.agent import Agent
from reach.caller.client import ReachClient
from reach.caller.routecache import RouteCache
from reach.tasks import step_now
from reach.transport import Message, connect
from reach.wire import envelope

__all__ = ["STACKS", "UNAVAILABLE", "Call", "Context", "Stack", "register"]

#: one call of the stack under test: payload in, decoded reply out
Call = Callable[[dict[str, Any]], Awaitable[Any]]

#: how long a caller waits for its responder to become routable
_READY_TIMEOUT = 30.0


@dataclass(frozen=True)
class Context:
    """Where a stack runs: the NATS URL, and names unique to this run and stack."""

    url: str
    run_id: str
    stack: str

    @property
    def token(self) -> str:
        """A NATS subject token naming this stack in this run."""
        return f"{self.stack.replace('-', '_')}_{self.run_id}"

    @property
    def subject(self) -> str:
        return f"bench.{self.token}"

    @property
    def capability(self) -> str:
        return f"bench_{self.token}"

    @property
    def agent_id(self) -> str:
        return f"bench-{self.stack}-{self.run_id}"


@dataclass(frozen=True)
class Stack:
    name: str
    description: str
    responder: Callable[[Context], AbstractAsyncContextManager[None]]
    caller: Callable[[Context], AbstractAsyncContextManager[Call]]
    #: announces agents: the bench runs a registrar process for it
    needs_registry: bool = False
    #: runs on this stack's responder and caller (see the module's doc); its hooks get
    #: that stack's ``Context``
    variant_of: str | None = None
    #: entered around each measurement block of this stack
    switch: Callable[[Context], AbstractContextManager[None]] = lambda _ctx: nullcontext()


STACKS: dict[str, Stack] = {}

#: optional stacks left out because their framework does not import: name -> why
UNAVAILABLE: dict[str, str] = {}


def register(stack: Stack) -> Stack:
    """Add a stack; the order of registration is the order of the table (baseline first)."""
    if stack.name in STACKS:
        raise ValueError(f"stack {stack.name!r} is registered twice")
    STACKS[stack.name] = stack
    return stack


# -- raw nats-py: the baseline ---------------------------------------------------------


@asynccontextmanager
async def _raw_responder(ctx: Context) -> AsyncIterator[None]:
    nc = await nats.connect(ctx.url, name=f"bench-responder-{ctx.stack}")

    async def echo(msg: Any) -> None:
        # decode and encode again: the same msgpack work an agent's handler pays for
        await msg.respond(msgpack.packb(msgpack.unpackb(msg.data), use_bin_type=True))

    await nc.subscribe(ctx.subject, cb=echo)
    await nc.flush()
    try:
        yield
    finally:
        await nc.close()


@asynccontextmanager
async def _raw_caller(ctx: Context) -> AsyncIterator[Call]:
    nc = await nats.connect(ctx.url, name=f"bench-caller-{ctx.stack}")
    subject = ctx.subject

    async def call(payload: dict[str, Any]) -> Any:
        msg = await nc.request(subject, msgpack.packb(payload, use_bin_type=True), timeout=5.0)
        return msgpack.unpackb(msg.data)

    try:
        yield call
    finally:
        await nc.close()


register(
    Stack(
        "raw",
        "nats-py nc.request to a subscriber answering with msg.respond (msgpack echo)",
        _raw_responder,
        _raw_caller,
    )
)


# -- Agent-Reach ---------------------------------------------------------------------


def _manifest(ctx: Context, *, schemas: bool) -> dict[str, Any]:
    return {
        "agent_id": ctx.agent_id,
        "agent_name": "bench_echo",
        "version": "1.0.0",
        # above the 128 calls in flight of the heaviest load: admission must not refuse
        "max_concurrency": 1024,
        "capabilities": [
            {
                "name": ctx.capability,
                "description": "Echo a market-report request (benchmark)",
                "input_schema": PAYLOAD_SCHEMA if schemas else {},
                "output_schema": PAYLOAD_SCHEMA if schemas else {},
                "tags": ["bench", "echo", "report-request"],
                "latency_sla_ms": 1000,
                "security_level": 1,
            }
        ],
    }


def _reach_responder(
    *, schemas: bool, tokens: bool = True
) -> Callable[[Context], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def responder(ctx: Context) -> AsyncIterator[None]:
        agent = Agent(_manifest(ctx, schemas=schemas), servers=ctx.url)
        agent._verify_tokens = tokens  # the variant without call tokens

        async def echo(req: dict[str, Any]) -> dict[str, Any]:
            return req

        agent.capability(ctx.capability)(echo)
        async with agent:
            yield

    return responder


#: the live ReachClient of each Agent-Reach stack (by stack name), for its variants
_CLIENTS: dict[str, ReachClient] = {}


def _reach_caller(*, validate: bool) -> Callable[[Context], AbstractAsyncContextManager[Call]]:
    @asynccontextmanager
    async def caller(ctx: Context) -> AsyncIterator[Call]:
        capability = ctx.capability
        async with ReachClient(
            servers=ctx.url, name=f"bench-caller-{ctx.stack}", validate=validate
        ) as client:

            def routable(cache: RouteCache) -> bool:
                return any(i.status == "healthy" for i in cache.find(capability))

            await client.routes.wait_for(routable, timeout=_READY_TIMEOUT)
            _CLIENTS[ctx.stack] = client
            try:
                yield _reach_call(client, capability)
            finally:
                _CLIENTS.pop(ctx.stack, None)

    return caller


def _reach_call(client: ReachClient, capability: str) -> Call:
    async def call(payload: dict[str, Any]) -> Any:
        return (await client.call(capability, payload)).value

    return call


@asynccontextmanager
async def _same_caller(ctx: Context) -> AsyncIterator[Call]:
    """The caller of the stack this one is a variant of (``ctx`` is that stack's)."""
    yield _reach_call(_CLIENTS[ctx.stack], ctx.capability)


@contextmanager
def _audit_off(ctx: Context) -> Iterator[None]:
    """No audit events while the block runs: the client's writer is idle (its calls skip
    recording), everything else stays as it is. Its requests still say that their caller
    records them (``au``), so that the callee does not record them in its place: the
    variant measures the fabric without audit, not audit moved to the callee."""
    client = _CLIENTS[ctx.stack]
    recorder = client._recorder
    writer, recorder.audit = recorder.audit, None  # the attempts still mark ``au``
    try:
        yield
    finally:
        recorder.audit = writer


register(
    Stack(
        "reach",
        "Agent-Reach, everything on: token check, caller and callee validate input/output"
        " schemas, scored routing, breaker, retry budget, deadline, audit events",
        _reach_responder(schemas=True),
        _reach_caller(validate=True),
        needs_registry=True,
    )
)

register(
    Stack(
        "reach-notoken",
        "Agent-Reach without the callee's token check (the caller still sends its token)",
        _reach_responder(schemas=True, tokens=False),
        _reach_caller(validate=True),
        needs_registry=True,
    )
)

register(
    Stack(
        "reach-novalidate",
        "Agent-Reach without contracts: ReachClient(validate=False), empty schemas on the agent",
        _reach_responder(schemas=False),
        _reach_caller(validate=False),
        needs_registry=True,
    )
)

register(
    Stack(
        "reach-noaudit",
        "Agent-Reach without audit events: reach's own processes and client, its audit"
        " writer set aside while these blocks run",
        _reach_responder(schemas=True),
        _same_caller,
        needs_registry=True,
        variant_of="reach",
        switch=_audit_off,
    )
)


# -- Agent-Reach's transport alone: the floor under its features ----------------------


@asynccontextmanager
async def _transport_responder(ctx: Context) -> AsyncIterator[None]:
    conn = await connect([ctx.url], name=f"bench-responder-{ctx.stack}")
    pending: set[asyncio.Task[None]] = set()

    def echo(data: bytes) -> bytes:
        reply: bytes = msgpack.packb(msgpack.unpackb(data), use_bin_type=True)
        return reply

    def on_request(msg: Message) -> None:
        if envelope.is_batch(msg.data):
            batch = conn.reply_batch(msg)
            for token, request in envelope.unpack_batch(msg.data):
                batch.add(token, echo(request))
            batch.flush()
        else:
            # answered right here, as the agent answers a call (a task only if it waits)
            task = step_now(conn.respond(msg, echo(msg.data)))
            if task is not None:
                pending.add(task)
                task.add_done_callback(pending.discard)

    await conn.subscribe_inline(ctx.subject, on_request)
    await conn.flush()
    try:
        yield
    finally:
        await conn.close()


@asynccontextmanager
async def _transport_caller(ctx: Context) -> AsyncIterator[Call]:
    conn = await connect([ctx.url], name=f"bench-caller-{ctx.stack}")
    request = conn.raw_request
    subject = ctx.subject

    async def call(payload: dict[str, Any]) -> Any:
        data = await request(subject, msgpack.packb(payload, use_bin_type=True), 5.0, True)
        return msgpack.unpackb(data)

    try:
        yield call
    finally:
        await conn.close()


register(
    Stack(
        "reach-transport",
        "Agent-Reach's transport alone: its request mux and batches, a subscriber echoing"
        " each request (msgpack) into reply batches; no envelope, token, contract, routing"
        " or audit (the floor under Agent-Reach's features)",
        _transport_responder,
        _transport_caller,
    )
)

# -- frameworks users would otherwise pick ---------------------------------------------


@asynccontextmanager
async def _micro_responder(ctx: Context) -> AsyncIterator[None]:
    nc = await nats.connect(ctx.url, name=f"bench-responder-{ctx.stack}")

    async def echo(req: Request) -> None:
        await req.respond(msgpack.packb(msgpack.unpackb(req.data), use_bin_type=True))

    service = await add_service(nc, name=f"bench_{ctx.token}", version="1.0.0")
    await service.add_endpoint(name="echo", subject=ctx.subject, handler=echo)
    # add_endpoint does not flush: make the subscription known to the server before READY
    await nc.flush()
    try:
        yield
    finally:
        await service.stop()
        await nc.close()


register(
    Stack(
        "micro",
        "nats-py micro service (nats.micro add_service, one endpoint in the default queue"
        " group, per-request stats) answering req.respond (msgpack echo); caller as raw",
        _micro_responder,
        # the caller side of micro is plain request/reply: the very same code as raw's
        _raw_caller,
    )
)


try:
    from faststream.nats import NatsBroker, NatsMessage
except ImportError as exc:
    UNAVAILABLE["faststream"] = (
        f"FastStream does not import ({exc}); pip install -e '.[bench]' (make bench does)"
    )
else:

    async def _msgpack_body(msg: NatsMessage) -> Any:
        return msgpack.unpackb(msg.body)

    def _faststream_broker(ctx: Context, role: str) -> NatsBroker:
        # same connection options as raw (nats-py defaults) but for the name; logger=None:
        # no log line per message, as raw and Agent-Reach write none
        return NatsBroker(ctx.url, name=f"bench-{role}-{ctx.stack}", logger=None)

    @asynccontextmanager
    async def _faststream_responder(ctx: Context) -> AsyncIterator[None]:
        broker = _faststream_broker(ctx, "responder")

        @broker.subscriber(ctx.subject, decoder=_msgpack_body)
        async def echo(body: dict[str, Any]) -> bytes:
            data: bytes = msgpack.packb(body, use_bin_type=True)
            return data

        await broker.start()
        # the broker does not flush its subscriptions: make them known before READY
        await (await broker.connect()).flush()
        try:
            yield
        finally:
            await broker.stop()

    @asynccontextmanager
    async def _faststream_caller(ctx: Context) -> AsyncIterator[Call]:
        broker = _faststream_broker(ctx, "caller")
        await broker.start()
        subject = ctx.subject

        async def call(payload: dict[str, Any]) -> Any:
            packed = msgpack.packb(payload, use_bin_type=True)
            reply = await broker.request(packed, subject, timeout=5.0)
            return msgpack.unpackb(reply.body)

        try:
            yield call
        finally:
            await broker.stop()

    register(
        Stack(
            "faststream",
            "FastStream NatsBroker: broker.request to a @broker.subscriber (msgpack decoder,"
            " handler args checked by FastDepends/pydantic as by default, bytes reply);"
            " no per-message log lines",
            _faststream_responder,
            _faststream_caller,
        )
    )
