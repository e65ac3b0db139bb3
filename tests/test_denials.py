"""Permission refusals: Denials.guard ends an operation on the server's refusal of what
it publishes, and on nothing else (the logic alone); and on a fabric `reach up` started,
with real permissions, a refused request, stream read, bucket opening or KV write is
PermissionDenied at once, not a timeout."""

from __future__ import annotations

import asyncio

import pytest

from reach.errors import AuthError, NoResponders, PermissionDenied
from reach.security.membership import connect_as
from reach.transport.denials import Denials, api_refusal_of, refusal_of
from reach.wire import subjects

from .up_helpers import Secured, secured_agent

REFUSED_PROBE = 'nats: permissions violation for publish to "reach.v1.probe.a-1"'
REFUSED_READ = (
    'nats: permissions violation for publish to "$js.api.consumer.create.reach_audit.x.y"'
)
REFUSED_GET = 'nats: permissions violation for publish to "$js.api.stream.msg.get.reach_audit"'


async def test_a_refusal_of_its_subject_ends_the_operation_at_once() -> None:
    denials = Denials()
    never = asyncio.Event()
    guarded = asyncio.create_task(
        denials.guard(never.wait(), "probe a-1", refusal_of("reach.v1.probe.a-1"))
    )
    await asyncio.sleep(0)
    denials.add(REFUSED_PROBE)
    with pytest.raises(PermissionDenied, match=r"probe a-1: .*reach\.v1\.probe\.a-1"):
        await asyncio.wait_for(guarded, 5)
    assert not denials._waiting


async def test_other_refusals_leave_it_alone() -> None:
    denials = Denials()
    done = asyncio.Event()

    async def read() -> str:
        await done.wait()
        return "read"

    guarded = asyncio.create_task(
        denials.guard(read(), "read", api_refusal_of("CONSUMER.CREATE", "REACH_AUDIT"))
    )
    await asyncio.sleep(0)
    denials.add(REFUSED_PROBE)  # another subject
    denials.add(REFUSED_GET)  # another request about the same stream
    await asyncio.sleep(0)
    assert not guarded.done()
    done.set()
    assert await guarded == "read"


async def test_a_read_is_ended_by_the_refusal_of_its_consumer() -> None:
    denials = Denials()
    guarded = asyncio.create_task(
        denials.guard(
            asyncio.Event().wait(), "read", api_refusal_of("CONSUMER.CREATE", "REACH_AUDIT")
        )
    )
    await asyncio.sleep(0)
    denials.add(REFUSED_READ)
    with pytest.raises(PermissionDenied):
        await guarded


async def test_a_cancel_from_outside_stays_a_cancel() -> None:
    denials = Denials()
    guarded = asyncio.create_task(
        denials.guard(asyncio.Event().wait(), "probe", refusal_of("reach.v1.probe.a-1"))
    )
    await asyncio.sleep(0)
    guarded.cancel()
    denials.add(REFUSED_PROBE)  # arriving with the cancel: the cancel wins
    with pytest.raises(asyncio.CancelledError):
        await guarded
    assert not denials._waiting


async def test_its_own_errors_and_results_pass_through() -> None:
    denials = Denials()

    async def fails() -> None:
        raise TimeoutError("no reply")

    async def cancels_itself() -> None:
        raise asyncio.CancelledError

    async def answers() -> int:
        return 7

    refuses = refusal_of("reach.v1.probe.a-1")
    with pytest.raises(TimeoutError, match="no reply"):
        await denials.guard(fails(), "probe", refuses)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.create_task(denials.guard(cancels_itself(), "probe", refuses))
    assert await denials.guard(answers(), "probe", refuses) == 7
    assert not denials._waiting


# -- against a fabric reach up started, with real permissions --------------------------


async def test_a_refused_request_or_kv_write_is_permission_denied_not_a_timeout(
    secured: Secured,
) -> None:
    async with secured_agent(secured):
        conn, _ = await connect_as([secured.url], name="watcher", credentials=secured.watcher)
        try:
            # a caller may not probe an agent: the server drops the request and says so
            with pytest.raises(PermissionDenied, match=r"reach\.v1\.probe\.a-1") as caught:
                await conn.request(subjects.probe("a-1"), b"", timeout=1.0)
            assert isinstance(caught.value, AuthError)
            assert "refused these credentials" in str(caught.value)
            # a subject it may publish to, where nobody listens: not blamed on the refusal
            with pytest.raises(NoResponders):
                await conn.request(subjects.capability("nobody_here"), b"", timeout=1.0)
            # it may read the registry, not write it
            registry = await conn.key_value(subjects.REGISTRY_BUCKET, create=False)
            assert await registry.get("agent.a-1") is not None
            with pytest.raises(PermissionDenied, match="KV put"):
                await registry.put("agent.forged-1", b"{}")
        finally:
            await conn.close()


async def test_a_refusal_ends_the_operation_at_once_not_at_its_timeout(
    secured: Secured,
) -> None:
    """nats-server reports a refused publish at once (an -ERR on the connection): a
    request, a stream read or a bucket opening ends as soon as the refusal arrives, not
    at its own timeout (which would keep `reach agents` with a caller's credentials
    waiting): well within deadlines far shorter than their timeouts."""
    async with secured_agent(secured):
        conn, _ = await connect_as([secured.url], name="watcher", credentials=secured.watcher)
        try:
            async with asyncio.timeout(10):  # the request's own timeout: 60 s
                with pytest.raises(PermissionDenied, match=r"reach\.v1\.probe\.a-1"):
                    await conn.request(subjects.probe("a-1"), b"", timeout=60.0)
            audit = await conn.stream(subjects.AUDIT_STREAM, create=False, check=False)
            async with asyncio.timeout(3):  # nats-py's JetStream API timeout: 5 s
                with pytest.raises(PermissionDenied, match="read REACH_AUDIT"):
                    async for _ in audit.read():
                        pass
            async with asyncio.timeout(3):
                with pytest.raises(PermissionDenied, match="open stream REACH_AUDIT"):
                    await conn.stream(subjects.AUDIT_STREAM, create=False)
            async with asyncio.timeout(3):  # no jobs role
                with pytest.raises(PermissionDenied, match="open KV bucket REACH_JOBS"):
                    await conn.key_value(subjects.JOBS_BUCKET, create=False)
            # the connection is as good as before: what it may do, it does
            registry = await conn.key_value(subjects.REGISTRY_BUCKET, create=False)
            assert await registry.get("agent.a-1") is not None
        finally:
            await conn.close()
