"""The growth benchmark runs end to end with tiny counts, so that it never rots.

No timing assertions: only that every point was measured, with sane numbers.
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


def test_growth_bench_measures_every_point_and_writes_the_json(tmp_path: Path) -> None:
    out = tmp_path / "results" / "growth.json"
    cmd = [sys.executable, "-m", "bench.growth", "--quick", "--instances", "1,3"]
    cmd += ["--callers", "1,2", "--callers-instances", "2", "--in-flight", "4"]
    cmd += ["--duration", "0.5", "--warmup", "0.2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]

    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "growth"
    assert doc["machine"]["nats_server"] != "unknown"
    assert [p["instances"] for p in doc["by_instances"]] == [1, 3]
    assert [p["callers"] for p in doc["by_instances"]] == [1, 1]
    assert [p["callers"] for p in doc["by_callers"]] == [1, 2]
    assert all(p["instances"] == 2 for p in doc["by_callers"])
    assert [p["host_processes"] for p in doc["by_instances"]] == [1, 3]
    for point in [*doc["by_instances"], *doc["by_callers"]]:
        assert point["errors"] == 0, point["first_error"]
        assert point["calls"] > 0
        assert point["calls_per_sec"] > 0
        assert point["in_flight_per_caller"] == 4
        assert len(point["per_caller_calls_per_sec"]) == point["callers"]
        latency = point["latency_ms"]
        assert 0 < latency["p50"] <= latency["p90"] <= latency["p99"]
    assert doc["chart"] or doc["chart_note"]
    assert "Growing the callee instances" in proc.stdout
    assert "Growing the caller processes" in proc.stdout
