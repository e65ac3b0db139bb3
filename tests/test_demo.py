"""`reach demo` runs the seed scenario end to end, fails no call and cleans up."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REACH = str(Path(sys.executable).parent / "reach")


def _leftovers() -> list[str]:
    """Processes the demo starts: data-query agents and the nats-server on its temp store."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "reach.demo.data_query" in text or "reach-demo-" in text:
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
    assert _leftovers() == []
