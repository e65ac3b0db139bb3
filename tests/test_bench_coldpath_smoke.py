"""The cold-path benchmark runs end to end with tiny counts, so that its script never rots.

No timing assertions: only that every piece was measured, warm and after a gap.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.coldpath import pieces

#: CI runs these after `make test` (`make test-long`)
pytestmark = pytest.mark.bench_smoke

ROOT = Path(__file__).resolve().parent.parent


def test_coldpath_bench_measures_every_piece_and_writes_the_json(tmp_path: Path) -> None:
    out = tmp_path / "coldpath.json"
    cmd = [sys.executable, "-m", "bench.coldpath", "--quick", "--gap-ms", "0.1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]

    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "coldpath"
    assert doc["settings"] == {"samples": 50, "gap_ms": 0.1}
    assert set(doc["pieces"]) == set(pieces())
    for name, row in doc["pieces"].items():
        for mode in ("warm_us", "after_gap_us"):
            assert row[mode]["count"] == 50, name
            assert 0 < row[mode]["median"] <= row[mode]["p90"], name
        assert row["ratio"] > 0, name
    assert "callee: one call served" in proc.stdout


def test_the_callee_piece_serves_a_real_call() -> None:
    from reach.wire import envelope

    reply = envelope.unpack_reply(pieces()["callee: one call served (CallServer.handle)"]())
    assert reply.ok, reply
