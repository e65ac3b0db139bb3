"""The failover benchmark runs end to end with tiny counts, so that it never rots.

No timing assertions: only that both scenarios ran, the victim was seen going and the
JSON has the figures the table is made of. Failed calls are recorded, not asserted:
on a busy machine a probe can be late enough to change them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

#: CI runs these after `make test` (`make test-long`)
pytestmark = pytest.mark.bench_smoke

ROOT = Path(__file__).resolve().parent.parent


def test_failover_bench_kills_and_hangs_an_instance_and_writes_the_json(tmp_path: Path) -> None:
    out = tmp_path / "results" / "failover.json"
    cmd = [sys.executable, "-m", "bench.failover", "--quick", "--rate", "50", "--pre", "1"]
    cmd += ["--post", "1", "--warmup", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]

    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "failover"
    assert doc["settings"]["reps"] == 1
    assert doc["settings"]["instances"] == 3
    assert doc["machine"]["nats_server"] != "unknown"
    assert doc["attempts_tapped"] is True
    assert [r["scenario"] for r in doc["runs"]] == ["kill", "stop"]
    for run in doc["runs"]:
        assert run["calls"] > 0
        assert run["failed"] == sum(run["errors"].values())
        assert run["latency_before_ms"]["calls"] > 0
        assert run["latency_after_ms"]["calls"] > 0
        # the route cache saw the victim marked down: load ran until it was gone
        assert run["unhealthy_after_sec"] is not None
        assert run["gone_after_sec"] is not None
        assert run["unhealthy_after_sec"] <= run["gone_after_sec"]
    for run in doc["runs"]:
        summary = doc["summary"][run["scenario"]]
        assert summary["calls_total"] == run["calls"]
        assert summary["failed"]["per_rep"] == [run["failed"]]
        for key in ("extra_p99_ms", "unhealthy_after_sec", "gone_after_sec", "after_p99_ms"):
            assert set(summary[key]) == {"median", "min", "max", "per_rep"}
    assert "SIGKILL" in proc.stdout
    assert "SIGSTOP" in proc.stdout
