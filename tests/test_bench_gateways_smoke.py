"""The gateways benchmark runs end to end with tiny counts, so that it never rots.

No timing assertions: only that every caller was measured through its gateway, without
a failed call, logged in where the gateway asks for it, and that the JSON has the
figures the table is made of.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mcp", reason="the MCP SDK is the gateways extra: pip install '.[gateways]'")

#: CI runs these after `make test` (`make test-long`)
pytestmark = pytest.mark.bench_smoke

ROOT = Path(__file__).resolve().parent.parent
CALLERS = ["direct", "mcp-stdio", "mcp-http", "mcp-http-wire", "a2a", "a2a-wire"]


def test_gateways_bench_calls_through_every_gateway_and_writes_the_json(tmp_path: Path) -> None:
    out = tmp_path / "results" / "gateways.json"
    cmd = [sys.executable, "-m", "bench.gateways", "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "mcp-http: adds" in proc.stdout, proc.stdout

    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "gateways"
    assert doc["machine"]["nats_server"] != "unknown"
    assert list(doc["summary"]) == CALLERS
    assert set(doc["targets"]) == {"mcp-stdio", "mcp-http", "a2a"}
    # a fabric with tokens: each HTTP gateway asks its callers to log in, and they did
    http = ["mcp-http", "mcp-http-wire", "a2a", "a2a-wire"]
    assert doc["logged_in"] == dict.fromkeys(http, True)
    seq = doc["settings"]["seq_calls"]
    for name, figures in doc["summary"].items():
        assert figures["errors"] == 0, (name, figures["first_error"])
        (block,) = doc["samples"][name]
        assert len(block["latencies_ms"]) == seq
        assert block["calls"] > 0
        assert 0 < figures["p50_ms"]["median"] <= figures["p99_ms"]["median"]
        if name != "direct":
            assert figures["ratio_p50"]["median"] > 0
            assert figures["cpu_us_per_call"]["gateway"]["median"] is not None, name
    assert doc["summary"]["direct"]["ratio_p50"]["median"] == 1.0
