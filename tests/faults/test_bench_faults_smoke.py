"""``python -m bench.faults`` runs end to end with tiny counts, so that it never rots.

Only the baseline scenario (a fabric, three instances, a caller): the JSON has the
figures and checks the table is made of, and the markdown table is written beside it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.bench_smoke, pytest.mark.timeout(180)]


def test_faults_bench_runs_a_scenario_and_writes_the_json_and_the_table(tmp_path: Path) -> None:
    out = tmp_path / "results" / "faults.json"
    cmd = [sys.executable, "-m", "bench.faults", "--quick", "--scenarios", "baseline"]
    cmd += ["--pre", "1", "--post", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]

    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "faults"
    assert doc["timing"]["rate"] == 50.0
    (run,) = doc["runs"]
    assert run["scenario"] == "baseline"
    assert run["sent"] > 0
    assert {c["name"] for c in run["checks"]} >= {
        "failed calls",
        "audit events by call id",
        "every instance back in rotation",
    }
    table = out.with_suffix(".md").read_text()
    assert "| scenario | sent | ok | audit events kept | what happened |" in table
    assert "| baseline |" in table
    assert table in proc.stdout
