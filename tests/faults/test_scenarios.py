"""Issue 24's fault scenarios with real processes: the fabric (``reach up``, ``reach up
--cluster 3``, or nats-server and ``reach up --auth-callout`` apart), three instances of one
echo capability and an open-loop caller, each its own OS process.

Every scenario asserts, through the engine of ``bench.faults`` (the benchmark runs the
same code for longer and faster):

- calls failed: none for an idempotent capability; for a non-idempotent one only those
  in flight on the instance that was killed;
- REACH_AUDIT, read with the admin credentials, holds exactly one caller event per call
  (matched by call id: none missing, none twice);
- every instance serves calls again by the end (a killed one is started again);
- the scenario's own targets (a restarted process back in time, shares after a pause,
  breaker timings), and the time to recover is measured.

The outcome's checks are printed when one fails. Load: 40 calls/s, a few seconds before
and after the fault (``bench.faults.TESTS``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.faults import TESTS, report, run_scenario
from bench.faults.fabric import Fabric

# every scenario runs in `make test-faults` (CI runs it after `make test`)
pytestmark = [pytest.mark.slow, pytest.mark.faults_long, pytest.mark.timeout(300)]


async def _scenario(name: str, fabric: Fabric, tmp_path: Path) -> dict[str, Any]:
    outcome = await run_scenario(name, TESTS, tmp_path / "run", fabric=fabric)
    assert outcome["passed"], report(outcome)
    return outcome


async def test_baseline_every_call_succeeds_and_is_audited(
    single_node: Fabric, tmp_path: Path
) -> None:
    outcome = await _scenario("baseline", single_node, tmp_path)
    assert outcome["ok"] == outcome["sent"] == outcome["audit_kept"]


async def test_sigkill_of_one_of_three_idempotent_instances_fails_no_call(
    single_node: Fabric, tmp_path: Path
) -> None:
    outcome = await _scenario("kill-instance", single_node, tmp_path)
    assert outcome["ok"] == outcome["sent"]
    assert outcome["back_in_rotation_sec"] is not None


async def test_sigkill_of_a_non_idempotent_instance_fails_only_its_calls_in_flight(
    single_node: Fabric, tmp_path: Path
) -> None:
    """A young caller (a few seconds of load): its retry budget must still cover the
    retries of the calls that found the killed instance gone."""
    await _scenario("kill-non-idempotent", single_node, tmp_path)


async def test_sigkill_of_the_single_nats_server_is_survived(
    single_node: Fabric, tmp_path: Path
) -> None:
    """``reach up`` starts its nats-server again; clients reconnect, agents re-announce,
    the caller's breakers stay closed while it is back before the agents."""
    outcome = await _scenario("kill-server", single_node, tmp_path)
    assert outcome["ok"] == outcome["sent"]


async def test_sigkill_of_the_registrar_part_leaves_the_server_and_calls_alone(
    single_node: Fabric, tmp_path: Path
) -> None:
    """The registrar part (issuer, login gate, registrar) is a child of ``reach up`` whose
    pid is in ``<store>/registrar.pid``: killed, it is back within 2 s, the nats-server
    keeps running and calls keep flowing."""
    await _scenario("kill-registrar", single_node, tmp_path)


async def test_after_a_150ms_pause_every_instance_gets_its_share_again(
    single_node: Fabric, tmp_path: Path
) -> None:
    """Each of three equal instances has ≥ 20 % of the calls 10 s after one of them was
    paused for 150 ms (no starving instance)."""
    await _scenario("pause-short", single_node, tmp_path)


async def test_a_10s_hang_sets_the_instance_aside_during_the_hang_and_not_after(
    single_node: Fabric, tmp_path: Path
) -> None:
    """The hung instance is set aside within 1 s (its breaker opens, or the caller's
    outlier detection ejects it, whichever comes first); it serves again within 1 s of
    SIGCONT (its probes pass again: the ejection ends)."""
    await _scenario("hang-long", single_node, tmp_path)


async def test_the_login_gate_down_across_a_server_restart_closes_no_connection_for_good(
    operator_fabric: Fabric, tmp_path: Path
) -> None:
    """nats-server restarts while ``reach up --auth-callout`` (the login gate) is down for
    a few seconds; once the gate is back every client logs in again and no call fails."""
    await _scenario("gate-down-server-restart", operator_fabric, tmp_path)


async def test_sigkill_of_the_node_leading_the_credentials_is_survived(
    cluster3: Fabric, tmp_path: Path
) -> None:
    """``reach up --cluster 3``: the node leading KV_REACH_CREDENTIALS is SIGKILLed; the
    clients on it log in again on another node during the bucket's leader election, no
    call fails and no audit event is lost."""
    await _scenario("cluster-kill-credentials-leader", cluster3, tmp_path)


async def test_an_instance_raising_on_every_call_is_set_aside_within_5s(
    single_node: Fabric, tmp_path: Path
) -> None:
    """Its probes pass and its breaker stays closed (a handler's failure is an answer):
    the caller's outlier detection sets it aside, below 2 % of the attempts from 5 s on;
    only calls its handler failed fail."""
    await _scenario("crash-instance", single_node, tmp_path)


async def test_an_instance_crawling_at_5x_its_sla_is_set_aside_within_5s(
    single_node: Fabric, tmp_path: Path
) -> None:
    """Its probes pass; its attempts time out and are retried elsewhere (no call fails),
    and from 5 s on it gets below 0.5 % of the attempts."""
    await _scenario("crawl-instance", single_node, tmp_path)


async def test_a_stalled_node_under_the_caller_costs_its_calls_seconds_not_the_stall(
    cluster3: Fabric, tmp_path: Path
) -> None:
    """``reach up --cluster 3``: the node the caller is connected to is SIGSTOPped (it
    keeps its sockets open); calls started 3 s after the stall began or later succeed."""
    await _scenario("stall-caller-node", cluster3, tmp_path)


async def test_a_stalled_registrar_marks_nobody_unhealthy_when_it_resumes(
    single_node: Fabric, tmp_path: Path
) -> None:
    """``reach up``'s registrar part is SIGSTOPped while calls flow: no call fails, and
    once it resumes no instance is marked unhealthy or evicted on stale evidence."""
    await _scenario("stall-registrar", single_node, tmp_path)


async def test_with_every_breaker_open_a_call_waits_for_the_trial(
    single_node: Fabric, tmp_path: Path
) -> None:
    """Every instance hangs 1.5 s, long enough for every breaker of the caller to open and
    short of the registrar's verdict: calls started then wait for a half-open trial and
    are served once the instances resume (none fails with CircuitOpen); calls in flight
    at the hang may fail only once every attempt they made timed out."""
    outcome = await _scenario("all-breakers-open", single_node, tmp_path)
    assert outcome["facts"]["started_all_open"] > 0
    assert "CircuitOpen" not in outcome["errors"]


async def test_a_full_disk_is_named_and_recovered_from_with_no_call_or_event_lost(
    small_disk_fabric: Fabric, tmp_path: Path
) -> None:
    """The store's disk (a small tmpfs) fills while calls flow: ``reach up`` names it, no
    call fails, and once the disk has room the store takes writes within 10 s; every
    call's audit event, held meanwhile, is stored once."""
    outcome = await _scenario("disk-full", small_disk_fabric, tmp_path)
    assert outcome["ok"] == outcome["sent"] == outcome["audit_kept"]
