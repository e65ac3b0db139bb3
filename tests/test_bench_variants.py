"""A benchmark variant (reach-noaudit) runs on its base's processes and client, with the
feature off only while its own blocks run: against a real nats-server and responder. And
the order of the blocks gives no stack a fixed neighbour."""

from __future__ import annotations

import os
from collections import Counter
from itertools import pairwise

import pytest

from bench.callpath import balanced_orders, check_variants, launch
from bench.payload import PAYLOAD
from bench.stacks import _CLIENTS, STACKS


@pytest.mark.parametrize("n", range(1, 9))
def test_every_stack_follows_every_other_equally_often(n: int) -> None:
    orders = balanced_orders(n)
    assert len(orders) == (n if n % 2 == 0 else 2 * n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    firsts = Counter(order[0] for order in orders)
    follows = Counter(pair for order in orders for pair in pairwise(order))
    assert set(firsts.values()) == {len(orders) // n}
    if n > 1:
        assert len(follows) == n * (n - 1)  # every ordered pair of two stacks...
        assert len(set(follows.values())) == 1  # ...as often as any other


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
