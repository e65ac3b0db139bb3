"""Which registrar sweeps which instance: rendezvous hashing over the live registrars,
computed from their records alone (no NATS)."""

from __future__ import annotations

from reach.registry.ownership import LIVE_INTERVALS, Ownership
from reach.wire.models import RegistrarRecord

AGENTS = [f"agent-{n}" for n in range(200)]
NOW = 1_700_000_000.0


def _record(registrar_id: str, seen_at: float = NOW, interval: float = 1.0) -> RegistrarRecord:
    return RegistrarRecord(
        registrar_id=registrar_id, started_at=0.0, seen_at=seen_at, interval_sec=interval
    )


def _views(*ids: str) -> dict[str, Ownership]:
    views = {rid: Ownership(rid) for rid in ids}
    for view in views.values():
        for rid in ids:
            view.seen(rid, _record(rid))
    return views


def test_a_lone_registrar_owns_every_instance() -> None:
    alone = Ownership("reg-a")
    assert all(alone.owns(agent, NOW) for agent in AGENTS)


def test_each_instance_has_exactly_one_owner_and_work_is_split() -> None:
    views = _views("reg-a", "reg-b", "reg-c")
    counts = dict.fromkeys(views, 0)
    for agent in AGENTS:
        owners = [rid for rid, view in views.items() if view.owns(agent, NOW)]
        assert len(owners) == 1, agent
        counts[owners[0]] += 1
    assert all(count > 0 for count in counts.values()), counts


def test_a_stopped_registrar_s_instances_move_to_the_others_and_only_those() -> None:
    views = _views("reg-a", "reg-b", "reg-c")
    before = {agent: views["reg-a"].owns(agent, NOW) for agent in AGENTS}
    for rid in ("reg-a", "reg-b"):
        views[rid].gone("reg-c")
    for agent in AGENTS:
        owners = [rid for rid in ("reg-a", "reg-b") if views[rid].owns(agent, NOW)]
        assert len(owners) == 1, agent
        if before[agent]:
            assert owners == ["reg-a"], f"{agent} moved though its owner still runs"


def test_a_registrar_that_stopped_refreshing_its_record_drops_out() -> None:
    mine = Ownership("reg-a")
    mine.seen("reg-b", _record("reg-b", seen_at=NOW))
    theirs = [agent for agent in AGENTS if not mine.owns(agent, NOW)]
    assert theirs
    later = NOW + LIVE_INTERVALS * 1.0
    # remembered until ownership is told the time has come (the liveness refresh)
    assert not mine.owns(theirs[0], later)
    mine.expire(later)
    assert all(mine.owns(agent, later) for agent in AGENTS)


def test_a_new_registrar_takes_its_share() -> None:
    mine = Ownership("reg-a")
    assert all(mine.owns(agent, NOW) for agent in AGENTS)
    mine.seen("reg-b", _record("reg-b"))
    assert not all(mine.owns(agent, NOW) for agent in AGENTS)
