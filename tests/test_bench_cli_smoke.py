"""The command line benchmark runs end to end with tiny counts, so that it never rots.

No timing assertions: only that every command ran against a fabric of its own (and
succeeded: the benchmark stops at a command that fails), each timed as many times as
asked, and that the JSON has the figures the table is made of.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cli import COMMANDS

#: CI runs these after `make test` (`make test-long`)
pytestmark = pytest.mark.bench_smoke

ROOT = Path(__file__).resolve().parent.parent


def test_cli_bench_times_every_command_and_writes_the_json(tmp_path: Path) -> None:
    out = tmp_path / "results" / "cli.json"
    cmd = [sys.executable, "-m", "bench.cli", "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]

    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "cli"
    assert doc["machine"]["nats_server"] != "unknown"
    runs = doc["settings"]["runs"]
    installed = [c.label for c in COMMANDS if c.exe is None or shutil.which(c.exe)]
    assert [row["command"] for row in doc["commands"]] == installed
    assert doc["skipped"] == [c.label for c in COMMANDS if c.label not in installed]
    for row in doc["commands"]:
        for figure in ("wall_ms", "cpu_ms"):
            assert len(row[figure]["per_rep"]) == runs, row["command"]
            assert row[figure]["min"] <= row[figure]["median"] <= row[figure]["max"]
        assert row["wall_ms"]["min"] > 0
        assert (row["met"] is None) == (row["target_ms"] is None), row["command"]
    targets = {row["command"]: row["target_ms"] for row in doc["commands"] if row["target_ms"]}
    assert targets == {"reach --help": 150, "reach validate agent.yaml": 300, "reach agents": 400}
    assert "reach agents" in proc.stdout
