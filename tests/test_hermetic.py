"""What a user leaves around does not change what the tests do: a ``.reach/dev.creds``
where the run starts (``reach up`` writes one into the checkout) and REACH_URL,
REACH_CREDS set for the user's own fabric. Tests that count on an open fabric's caller
name (no credentials) are run in a pytest of their own, started amid both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: tests whose outcome depends on finding no credentials: an open fabric names its
#: callers by connection name ("reach-client"), a credential would name them "dev"
OPEN_FABRIC_TESTS = (
    "tests/test_audit_events.py::test_a_successful_call",
    "tests/test_alerts_and_breakers.py::test_the_retry_alert_fires_at_the_eleventh_retry_in_a_minute",
)


def _plant_user_state(where: Path) -> dict[str, str]:
    """A ``.reach/dev.creds`` in ``where`` and the variables a user of `reach up` sets."""
    store = where / ".reach"
    store.mkdir(mode=0o700)
    creds = store / "dev.creds"
    creds.write_text(
        json.dumps({"url": "nats://127.0.0.1:9", "client_id": "dev", "secret": "x" * 43})
    )
    creds.chmod(0o600)
    bogus = where / "missing" / "bogus.creds"
    return {
        **os.environ,
        "REACH_CREDS": str(bogus),
        "REACH_URL": "nats://127.0.0.1:9",
        "REACH_RECONNECT_FOR": "not a duration",
        "REACH_AUDIT_SPOOL_MAX_MB": "-1",
    }


def test_a_users_credentials_and_variables_change_nothing(tmp_path: Path) -> None:
    env = _plant_user_state(tmp_path)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(ROOT),
        *(str(ROOT / test) for test in OPEN_FABRIC_TESTS),
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert f"{len(OPEN_FABRIC_TESTS)} passed" in proc.stdout, proc.stdout[-2000:]


def test_each_test_starts_in_an_empty_directory_without_reach_variables() -> None:
    assert list(Path.cwd().iterdir()) == []
    assert Path.cwd().resolve() != ROOT
    # the run's own (REACH_TEST_BUILD) and the test's own audit spool, no other
    kept = {"REACH_TEST_BUILD", "REACH_AUDIT_SPOOL"}
    assert not [name for name in os.environ if name.startswith("REACH_") and name not in kept]
