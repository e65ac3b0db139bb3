"""Denials.guard: an operation ended by the server's refusal of what it publishes, and by
nothing else (the logic alone; tests/test_hardening_operator.py shows it against a real
nats-server with real permissions)."""

from __future__ import annotations

import asyncio

import pytest

from reach.errors import PermissionDenied
from reach.transport.denials import Denials, api_refusal_of, refusal_of

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
