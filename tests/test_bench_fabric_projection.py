"""Part 4 of the discovery benchmark, from measured rows to the projection and the chart:
a registrar's cost per 10,000 instances is projected as a fixed part plus a part per
instance, the other figures with the growth measured, and the chart draws both."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from bench.fabricchart import write_fabric_chart
from bench.fabricscale import TARGET_SCALE, project


def row(instances: int, registrar_per_10k: float, visible_p99: float) -> dict[str, Any]:
    """A measured scale as ``callers_at_scale`` holds it, with the registrar keeping up."""
    seen = {"announce": {"p99": visible_p99}, "bye": {"p99": visible_p99 / 2}}
    return {
        "instances": instances,
        "heartbeat_replies_ok_ratio": 1.0,
        "visibility": {"requests_failed": 0, "used": seen, "all": seen},
        "caller_cpu_pct": {"used": 0.0, "all": 0.0},
        "caller_records_per_sec": {"used": 0.0, "all": 0.0},
        "registrar_cpu_pct_per_10k": registrar_per_10k,
        "kv_writes_per_sec_per_10k": 1.0,
        "registry_bytes_per_10k": 17_800_000,
        "messages_per_sec_per_10k": 4_200.0,
    }


def test_a_registrar_cost_is_projected_as_fixed_plus_per_instance() -> None:
    # 1 % of a core fixed, 1.5 % per 1,000 instances: 16 % at 10,000, 151 % at 100,000
    rows = [row(1_000, 25.0, 5.0), row(10_000, 16.0, 10.0)]
    at = project(rows)
    assert at["projected"] is True
    assert at["fixed_plus_per_instance"] == ["registrar_cpu_pct_per_10k"]
    assert at["registrar_cpu_pct_per_10k"] == pytest.approx(15.1)
    # the others with the growth measured between the scales: here a power law
    assert at["visible_p99_ms"] == pytest.approx(20.0)
    assert at["registry_bytes_per_10k"] == pytest.approx(17_800_000)


def test_a_registrar_cost_never_projects_below_nothing_per_instance() -> None:
    # a total that did not grow: all fixed, spread over more instances
    at = project([row(1_000, 50.0, 5.0), row(10_000, 5.0, 5.0)])
    assert at["registrar_cpu_pct_per_10k"] == pytest.approx(0.5)
    shrinking = project([row(1_000, 80.0, 5.0), row(10_000, 5.0, 5.0)])
    assert shrinking["registrar_cpu_pct_per_10k"] == pytest.approx(0.5)


def test_a_registrar_cost_that_rises_with_the_scale_keeps_its_growth() -> None:
    # per 10,000: 20 % at 3,000, 30 % at 10,000: a line through the totals would start
    # below zero and flatten the growth; the power law measured is kept
    at = project([row(3_000, 20.0, 5.0), row(10_000, 30.0, 5.0)])
    assert "registrar_cpu_pct_per_10k" not in at.get("fixed_plus_per_instance", [])
    assert at["registrar_cpu_pct_per_10k"] == pytest.approx(
        30.0 * 10 ** (math.log(1.5) / math.log(10 / 3)), rel=1e-3
    )
    assert at["registrar_cpu_pct_per_10k"] > 60.0


def test_one_scale_measured_twice_is_projected_flat() -> None:
    at = project([row(10_000, 16.0, 10.0), row(10_000, 18.0, 10.0)])
    assert at["registrar_cpu_pct_per_10k"] in (16.0, 18.0)


def test_a_measured_scale_is_not_projected() -> None:
    at = project([row(10_000, 16.0, 10.0), row(TARGET_SCALE, 14.0, 30.0)])
    assert at["projected"] is False
    assert at["registrar_cpu_pct_per_10k"] == 14.0


def test_the_chart_is_drawn_from_measured_scales_only(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path, note = write_fabric_chart(
        [row(1_000, 25.0, 5.0), row(10_000, 16.0, 10.0)], tmp_path / "f.png"
    )
    assert note == ""
    assert path is not None
    assert path.read_bytes().startswith(b"\x89PNG")
    behind = row(3_000, 20.0, 5.0)
    behind["heartbeat_replies_ok_ratio"] = 0.5  # a registrar that did not keep up
    path, note = write_fabric_chart([behind], tmp_path / "g.png")
    assert path is None
    assert "keeping up" in note
    assert not (tmp_path / "g.png").exists()
