"""`reach demo` runs the seed scenario end to end on a secured fabric, fails no call and
cleans up; its fabric lets no one in without credentials and its agents check tokens."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from reach.caller.client import ReachClient
from reach.demo.participants import DataQueryProcess, demo_fabric
from reach.errors import AuthenticationFailed
from reach.security.membership import connect_as
from reach.wire import envelope, subjects

#: an end-to-end run of whole programs: `make test-long` (CI runs it after `make test`)
# alone: each checks that no demo process is left, which a demo running beside it has
pytestmark = [pytest.mark.long, pytest.mark.serial]

REACH = str(Path(sys.executable).parent / "reach")


def _leftovers() -> list[str]:
    """Processes the demo starts: data-query agents and the nats-server on its temp store,
    run from this checkout's environment (another checkout's demo is not this one's)."""
    ours = str(Path(sys.executable).parent)
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if ours in text and ("reach.demo.data_query" in text or "reach-demo-" in text):
            found.append(text)
    return found


def test_demo_moves_traffic_off_the_saturated_and_killed_instances_with_no_failed_call() -> None:
    proc = subprocess.run(
        [REACH, "demo", "--duration", "10", "--rate", "30"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "failed            0" in out
    assert "degraded (not ready: connection pool 85% used)" in out
    assert "data-query-3" in out
    assert "data-query-2: removed from the registry" in out or "data-query-2: unhealthy" in out
    assert "alert unhealthy: data-query-2 turned unhealthy" in out
    assert "audit events" in out
    # the last audit events are shown, one line per call
    assert re.search(r"ok +\S+ → (generate_industry_report|query_industry_data)@", out)
    # the fabric is the secured one: it says what it refuses
    assert "a client without credentials is refused" in out
    assert "a call with a level-1 token is refused by its callee" in out
    # what it prints is its own account: no log line, no warning (alerts and the
    # denial are told once, as the demo's own lines)
    assert "WARNING" not in out + proc.stderr
    assert not [line for line in out.splitlines() if " refused for " in line]  # the log's
    assert proc.stderr == ""
    assert _leftovers() == []


@pytest.mark.parametrize("end", ["enter", "ctrl-c"])
def test_the_demo_keeps_its_fabric_up_for_the_commands_it_names_until_enter(end: str) -> None:
    demo = subprocess.Popen(
        [REACH, "demo", "--duration", "5", "--rate", "10", "--keep"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert demo.stdin is not None
    assert demo.stdout is not None
    try:
        lines: list[str] = []
        for line in demo.stdout:  # ends with the commands, then waits for Enter
            lines.append(line)
            if line.startswith("  reach doctor"):
                break
        tail = next(line for line in lines if line.startswith("  reach audit tail"))
        proc = subprocess.run(
            [REACH, *tail.split()[1:]], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        assert "scheduler → generate_industry_report@industry-report-1" in proc.stdout
        if end == "enter":
            demo.stdin.write("\n")
            demo.stdin.flush()
            assert demo.wait(30) == 0
        else:  # stops at once, and cleans up as after Enter
            demo.send_signal(signal.SIGINT)
            assert demo.wait(30) == 130
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        demo.stdout.close()
        demo.stdin.close()
    assert _leftovers() == []


async def test_the_demo_fabric_refuses_anonymous_clients_and_calls_without_a_valid_token(
    tmp_path: Path,
) -> None:
    async with demo_fabric(tmp_path) as fabric:
        agent = DataQueryProcess(fabric.url, "data-query-1", tmp_path, fabric.creds("data-query-1"))
        try:
            await agent.ready()
            with pytest.raises(AuthenticationFailed, match="refused an anonymous client"):
                await connect_as(fabric.urls, name="anonymous", credentials=None)
            # logged in, but a call whose token is missing or not the issuer's is denied
            # by the agent before its handler runs
            conn, _ = await connect_as(
                fabric.urls, name="no-token", credentials=fabric.creds("scheduler")
            )
            try:
                subject = subjects.capability_instance("query_industry_data", "data-query-1")
                for token in (None, "garbage.not.a-token"):
                    meta = envelope.RequestMeta(call_id=f"no-token-{token}", token=token)
                    request = envelope.pack_request(meta, b"\x80")
                    reply = envelope.unpack_reply(await conn.request(subject, request, 5))
                    assert not reply.ok
                    assert reply.kind == "denied"
            finally:
                await conn.close()
            # with its credentials the scheduler's calls carry tokens and get through
            async with ReachClient(
                servers=fabric.url, credentials=fabric.creds("scheduler")
            ) as scheduler:
                await scheduler.routes.wait_for(
                    lambda c: bool(c.find("query_industry_data")), timeout=10
                )
                result = await scheduler.call(
                    "query_industry_data", {"industry": "ev", "time_range": "2025Q3"}
                )
                assert result.value["served_by"] == "data-query-1"
        finally:
            agent.stop()
