"""The discovery benchmark runs end to end with tiny counts, so that its script never rots.

No timing assertions: only that every part was measured and the numbers are sane.
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


def test_discovery_bench_measures_every_part_and_writes_the_json(tmp_path: Path) -> None:
    out = tmp_path / "results" / "discovery.json"
    # one scale of heartbeating instances at both ages covers every path of part 3
    cmd = [sys.executable, "-m", "bench.discovery", "--quick", "--announces", "10"]
    cmd += ["--load-scales", "50", "--window", "2"]
    cmd += ["--no-chart", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]

    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "discovery"
    assert doc["machine"]["nats_server"] != "unknown"
    scales = doc["settings"]["scales"]
    assert [(r["layout"], r["instances"]) for r in doc["route_choice"]] == [
        (layout, n) for layout in ("spread", "one_capability") for n in scales
    ]
    for row in doc["route_choice"]:
        assert set(row["lookups"]) == set(doc["lookups"])
        for name, lookup in row["lookups"].items():
            assert lookup["count"] > 0, name
            assert 0 < lookup["median"] <= lookup["p99"], name
            assert lookup["result_size"] > 0, name
        assert row["cold_sync_ms"] > 0

    for decode in doc["record_decode_us"].values():
        assert 0 < decode["median"] <= decode["p99"]
        assert decode["record_bytes"] > 0

    vis = doc["visibility"]
    assert vis["not_seen_within_5s"] == 0
    assert vis["visible_ms"]["count"] == 10
    assert 0 < vis["visible_ms"]["median"] <= vis["visible_ms"]["p99"]
    assert vis["announce_reply_ms"]["median"] > 0

    load = doc["registrar_load"]
    ages = doc["settings"]["load_ages"]
    assert ages == ["young", "settled"]
    assert [(r["instances"], r["age"]) for r in load] == [
        (n, age) for n in doc["settings"]["load_scales"] for age in ages
    ]
    for young, settled in zip(load[::2], load[1::2], strict=True):
        # past their first day, instances are probed once per interval instead of twice
        assert settled["probes_per_sec"] < 0.8 * young["probes_per_sec"]
    for row in load:
        assert "error" not in row, row.get("error")
        assert row["announced"] == row["instances"]
        assert row["announce_failed"] == 0
        assert row["registrar_cpu_pct"] > 0
        assert row["kv_writes_per_sec"] > 0
        assert row["heartbeats_per_sec"] > 0
        assert row["heartbeat_replies_ok"] > 0
        # every simulated instance, the route key of its capability, and the registrar's
        # own liveness record
        assert row["registry_keys"] == 2 * row["instances"] + 1
        # the floor beside it: plain nats-py moved the same heartbeats and probes
        floor = row["raw_floor"]
        assert floor["cpu_pct"] > 0
        assert floor["heartbeats_per_sec"] > 0
        assert floor["heartbeat_replies_ok"] > 0
        assert floor["probes_per_sec"] > 0
        assert floor["probe_replies_per_sec"] > 0
        assert row["registrar_over_raw_floor"] > 0

    fabric = doc["callers_at_scale"]
    assert [r["instances"] for r in fabric] == doc["settings"]["fabric_scales"]
    for row in fabric:
        assert "error" not in row, row.get("error")
        assert row["announced"] == row["instances"]
        assert set(row["caller_cpu_pct"]) == {"used", "all"}
        assert row["registry_bytes"] > 0
        assert row["visibility"]["not_seen_within_5s"] == 0
        for mode in ("used", "all"):
            for kind in ("announce", "bye"):
                assert row["visibility"][mode][kind]["count"] == doc["settings"]["fabric_changes"]

    assert set(doc["targets"]) == {
        "route_choice_us",
        "announce_visible_ms",
        "caller_cpu_pct_at_100k",
        "change_visible_p99_ms_at_100k",
        "registrar_cpu_pct_per_10k",
    }
    assert "Route choice from the cache" in proc.stdout
    assert "Registrar under heartbeats" in proc.stdout
    assert "Callers on a fabric of heartbeating instances" in proc.stdout
