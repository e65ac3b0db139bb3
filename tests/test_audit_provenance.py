"""Who wrote an audit event: subject helpers, the verdict rule, and the alert rules'
use of the writer (pure, no NATS)."""

from __future__ import annotations

from typing import Any

import pytest

from reach.audit.alerts import AlertEngine
from reach.audit.batch import encode_batch
from reach.audit.eventmodels import AuditEvent
from reach.audit.provenance import REGISTRAR_WRITER, verdict
from reach.audit.reader import format_event
from reach.clock import ManualClock
from reach.security.natsconf import REGISTRAR_USER
from reach.wire import subjects
from tests.audit_helpers import make_event


def test_audit_subjects_carry_the_writer_as_their_last_token() -> None:
    assert subjects.audit("echo", "app") == "reach.v1.audit.echo.app"
    assert subjects.audited("echo", "app") == "reach.v1.audited.echo.app"
    assert subjects.writer_of("reach.v1.audit.echo.app") == "app"
    assert subjects.writer_of("reach.v1.audited.echo.app") == "app"
    # stored before subjects named their writer, or not an audit subject at all
    for subject in (
        "reach.v1.audit.echo",
        "reach.v1.audit.echo.app.more",
        "reach.v1.cap.echo.app",
        "other.v1.audit.echo.app",
        "reach.v1.audit.echo.a$b",
        "",
    ):
        assert subjects.writer_of(subject) == "", subject


def test_a_connection_writes_as_its_login_or_anonymous() -> None:
    assert subjects.writer_token("app-1") == "app-1"
    assert subjects.writer_token(None) == subjects.ANONYMOUS
    assert subjects.writer_token("a.b") == subjects.ANONYMOUS  # never a subject's tokens
    assert REGISTRAR_WRITER == REGISTRAR_USER


@pytest.mark.parametrize(
    ("side", "caller", "callee", "writer", "agents", "expected"),
    [
        ("caller", "app", "echo-1", "app", None, "verified"),
        ("caller", "victim", "echo-1", "app", None, "forged"),
        ("caller", "app", "echo-1", "", None, "unverified"),  # stored before writer tokens
        ("caller", "svc", "echo-1", subjects.ANONYMOUS, None, "unverified"),  # open fabric
        ("registrar", "app", "echo-1", REGISTRAR_WRITER, None, "verified"),
        ("registrar", "app", "echo-1", "app", None, "forged"),
        ("callee", "app", "echo-1", "echo-c", None, "unverified"),  # no credentials read
        ("callee", "app", "echo-1", "echo-c", {"echo-c": "echo-1"}, "verified"),
        ("callee", "app", "echo-1", "mallory", {"mallory": None}, "forged"),
        ("callee", "app", "echo-1", "other-c", {"other-c": "other-1"}, "forged"),
        ("callee", "app", "", "ghost", {}, "forged"),
        ("sideways", "app", "echo-1", "app", None, "forged"),
    ],
)
def test_an_event_is_genuine_when_its_writer_is_who_recorded_it(
    side: str,
    caller: str,
    callee: str,
    writer: str,
    agents: dict[str, str | None] | None,
    expected: str,
) -> None:
    assert verdict(side, caller, callee, writer, agents) == expected


def _event(**fields: Any) -> AuditEvent:
    values: dict[str, Any] = {
        "ts": 1.0,
        "capability": "secret_cap",
        "call_id": "FORGED-1",
        "caller": "victim",
        "callee": "victim-001",
        "outcome": "ok",
    }
    return AuditEvent.model_validate(values | fields)


def test_a_forged_event_is_marked_before_what_it_claims() -> None:
    line = format_event(_event(), writer="mallory", found="forged")
    assert line.index("FORGED? writer=mallory") < line.index("victim →")
    unverified = format_event(_event(), writer="", found="unverified")
    assert unverified.endswith("unverified writer=?")
    # an open fabric names nobody: nothing to mark on every line
    assert "writer" not in format_event(_event(), writer=subjects.ANONYMOUS, found="unverified")
    assert "writer" not in format_event(_event(), writer="victim", found="verified")


def _storm(caller: str, caller_agent: str | None = None) -> Any:
    failed = [{"agent_id": "dq-1", "outcome": "timeout"}] * 11
    return make_event(
        ts=1.0,
        capability="query",
        caller=caller,
        caller_agent=caller_agent,
        outcome="ok",
        attempts=[*failed, {"agent_id": "dq-2", "outcome": "ok"}],
    )


def test_the_alert_rules_count_rows_only_for_the_caller_that_wrote_them() -> None:
    engine = AlertEngine(clock=ManualClock())
    assert engine.observe_batch(encode_batch([_storm("victim")]), "mallory") == []
    # an agent id it claims to call from is not the writer's to choose: keyed by the writer
    (storm,) = engine.observe_batch(encode_batch([_storm("mallory", "victim-agent")]), "mallory")
    assert storm.key == "mallory→dq-1"
    assert storm.details["caller"] == "mallory"
    # an open fabric (anonymous writer) and events off the stream: as the body says
    (open_storm,) = AlertEngine(clock=ManualClock()).observe_batch(
        encode_batch([_storm("svc", "planner")]), subjects.ANONYMOUS
    )
    assert open_storm.key == "planner→dq-1"
    event = {"side": "caller", "capability": "query", "caller": "victim", "attempts": []}
    assert AlertEngine(clock=ManualClock()).observe(event, "mallory") == []
