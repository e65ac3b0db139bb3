"""The audit-cost benchmark runs end to end with tiny counts, so that it never rots.

No timing assertions: only that it wrote every event and says what it measured.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

#: CI runs these after `make test` (`make test-long`)
pytestmark = pytest.mark.bench_smoke

ROOT = Path(__file__).resolve().parent.parent


def test_auditcost_bench_records_and_writes_every_event() -> None:
    cmd = [sys.executable, "-m", "bench.auditcost", "--calls", "3000", "--runs", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = re.search(r"CPU per call: ([0-9.]+) µs \(median of 2 runs of 3,000 calls", proc.stdout)
    assert found, proc.stdout
    assert float(found.group(1)) > 0
