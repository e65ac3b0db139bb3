"""The benchmark runs end to end with tiny counts, so that its scripts never rot.

No timing assertions: only that every stack was measured and the numbers are sane. A stack
whose framework is an optional install is measured when it imports, and skipped (with the
reason) when it does not.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.report import percentile, spread
from bench.stacks import STACKS, UNAVAILABLE

#: CI runs these after `make test` (`make test-long`)
pytestmark = pytest.mark.bench_smoke

ROOT = Path(__file__).resolve().parent.parent

#: stacks of frameworks installed by the `bench` extra, not by the project itself
OPTIONAL_STACKS = ("faststream",)


def test_bench_measures_every_stack_and_writes_the_json(tmp_path: Path) -> None:
    out = tmp_path / "results" / "smoke.json"
    cmd = [sys.executable, "-m", "bench", "--quick", "--seq-calls", "20", "--duration", "0.1"]
    cmd += ["--warmup", "10", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]

    doc = json.loads(out.read_text())
    assert set(doc["summary"]) == set(STACKS)
    assert doc["baseline"] == "raw"
    assert doc["settings"]["concurrency"] == [1, 16, 128]
    assert doc["machine"]["cpu_count"] >= 1
    assert doc["machine"]["nats_server"] != "unknown"
    assert 150 <= doc["payload_bytes"] <= 250
    for name, summary in doc["summary"].items():
        assert summary["errors"] == 0, f"{name}: {summary['first_error']}"
        (seq,) = doc["samples"][name]["sequential"]
        assert len(seq["latencies_ms"]) == 20
        assert all(x > 0 for x in seq["latencies_ms"])
        latency = summary["latency_ms"]
        assert 0 < latency["p50"]["median"] <= latency["p90"]["median"] <= latency["p99"]["median"]
        for concurrency in ("1", "16", "128"):
            assert summary["calls_per_sec"][concurrency]["median"] > 0
            (run,) = doc["samples"][name]["throughput"][concurrency]
            assert run["calls"] > 0
            assert run["cpu"]["caller_sec"] >= 0
        raw_p50 = doc["summary"]["raw"]["latency_ms"]["p50"]["median"]
        ratio = summary["ratio_to_raw"]["latency_p50"]["median"]
        assert math.isclose(ratio, latency["p50"]["median"] / raw_p50)
    assert doc["charts"] or doc["charts_note"]
    for stack in STACKS:
        assert stack in proc.stdout


@pytest.mark.parametrize("stack", OPTIONAL_STACKS)
def test_an_optional_stack_is_measured_when_its_framework_imports(stack: str) -> None:
    if stack in UNAVAILABLE:
        pytest.skip(f"stack {stack!r} not measured: {UNAVAILABLE[stack]}")
    # registered stacks are the ones the run above measures
    assert stack in STACKS


def test_percentiles_interpolate_between_ranks() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == pytest.approx(4.6)
    assert percentile([7.0], 0.99) == 7.0


def test_a_spread_is_median_min_max_of_known_values() -> None:
    assert spread([3.0, None, 1.0, 2.0]) == {
        "median": 2.0,
        "min": 1.0,
        "max": 3.0,
        "per_rep": [3.0, None, 1.0, 2.0],
    }
    assert spread([None])["median"] is None
