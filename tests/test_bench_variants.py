"""A benchmark variant (reach-noaudit) runs on its base's processes and client, with the
feature off only while its own blocks run: against a real nats-server and responder."""

from __future__ import annotations

import os

import pytest

from bench.callpath import check_variants, launch
from bench.payload import PAYLOAD
from bench.stacks import _CLIENTS, STACKS


def test_a_variant_must_come_after_its_base() -> None:
    check_variants([STACKS["raw"], STACKS["reach"], STACKS["reach-noaudit"]])
    for stacks in ([STACKS["reach-noaudit"]], [STACKS["reach-noaudit"], STACKS["reach"]]):
        with pytest.raises(ValueError, match="--stacks reach,reach-noaudit"):
            check_variants(stacks)


async def test_the_audit_variant_shares_the_processes_and_skips_only_the_audit() -> None:
    creds = os.environ.get("REACH_CREDS")
    stacks = [STACKS["reach"], STACKS["reach-noaudit"]]
    async with launch(stacks, None, lambda _line: None) as bed:
        full, variant = bed.live
        assert variant.responder is full.responder  # one responder process for both
        assert variant.context == full.context
        client = _CLIENTS[full.context.stack]
        writer = client.audit
        assert writer is not None

        def recorded() -> int:
            return writer.pending + writer.written + writer.dropped

        before = recorded()
        with variant.stack.switch(variant.context):
            assert client.audit is None
            for _ in range(20):
                assert await variant.call(PAYLOAD) == PAYLOAD
        assert client.audit is writer  # back on once the block is over
        assert recorded() == before
        for _ in range(20):
            assert await full.call(PAYLOAD) == PAYLOAD
        assert recorded() == before + 20
    # the bench's credentials (removed with its temporary directory) are not left behind
    # for whoever runs next in this process
    assert os.environ.get("REACH_CREDS") == creds
