"""Manifest validation: every rule of the manifest (docs/manifest.md), and
errors that name the field; and the free text of readiness reports, transitions and
goodbyes, clipped so that records stay small."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from reach.errors import ConfigurationError
from reach.wire.models import Bye, Manifest, Readiness, Transition, parse_manifest

from .manifest_helpers import (
    ARCHITECTURE,
    MANIFEST_EXAMPLE,
    MAX_SLA_MS,
    manifest_with_schema,
    manifest_with_sla,
)


def manifest_data(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "agent_id": "agent-1",
        "agent_name": "report_generator",
        "version": "1.0.0",
        "capabilities": [{"name": "generate_report", "tags": ["report-generate"]}],
    }
    data.update(overrides)
    return data


def capability_data(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"name": "generate_report", "tags": ["report-generate"]}
    data.update(overrides)
    return data


def errors_of(data: Any) -> list[str]:
    with pytest.raises(ConfigurationError) as info:
        parse_manifest(data)
    return info.value.errors


def test_the_annotated_example_parses() -> None:
    manifest = parse_manifest(yaml.safe_load(MANIFEST_EXAMPLE))
    assert manifest.agent_id == "agent-report-gen-001"
    assert manifest.version == "2.3.1"
    assert manifest.mode == "async"
    cap = manifest.capability("generate_industry_report")
    assert cap is not None
    assert cap.tags == ["report-generate", "industry", "analytics"]
    assert cap.security_level == 2
    assert cap.latency_sla_ms == 5000
    assert cap.input_schema["required"] == ["industry", "time_range"]
    assert manifest.health.failures_before_unhealthy == 2


def test_a_minimal_manifest_gets_the_documented_defaults() -> None:
    manifest = parse_manifest(
        {"agent_name": "tiny", "version": "0.1.0", "capabilities": [{"name": "x"}]}
    )
    assert manifest.mode == "sync"
    assert manifest.capabilities[0].security_level == 4
    assert manifest.health.interval_sec == 15
    assert manifest.health.timeout_sec == 3
    assert manifest.health.failures_before_unhealthy == 2


def test_the_example_is_the_architecture_documents() -> None:
    assert f"```yaml\n{MANIFEST_EXAMPLE}```" in ARCHITECTURE.read_text()


def test_capability_defaults_to_the_highest_security_level() -> None:
    manifest = parse_manifest(manifest_data(capabilities=[{"name": "export_all"}]))
    assert manifest.capabilities[0].security_level == 4


def test_missing_agent_id_becomes_agent_name_dash_random() -> None:
    data = manifest_data()
    del data["agent_id"]
    first, second = parse_manifest(data), parse_manifest(data)
    assert re.fullmatch(r"report_generator-[0-9a-f]{8}", first.agent_id)
    assert first.agent_id != second.agent_id


def test_empty_agent_id_is_treated_as_missing() -> None:
    manifest = parse_manifest(manifest_data(agent_id=""))
    assert manifest.agent_id.startswith("report_generator-")


def test_generated_agent_id_of_a_long_name_is_still_a_valid_token() -> None:
    manifest = parse_manifest(manifest_data(agent_id=None, agent_name="n" * 128))
    assert len(manifest.agent_id) <= 128
    assert Manifest.model_validate(manifest.model_dump()) == manifest


@pytest.mark.parametrize("agent_id", ["agent-1", "Agent_2", "a", "x" * 128, "report-gen-001"])
def test_agent_ids_that_are_subject_tokens_are_accepted(agent_id: str) -> None:
    assert parse_manifest(manifest_data(agent_id=agent_id)).agent_id == agent_id


@pytest.mark.parametrize(
    "agent_id", ["a.b", "a b", "a*", "a>", "agent/1", "ägent", "x" * 129, "tab\there"]
)
def test_agent_ids_that_would_break_a_subject_are_rejected(agent_id: str) -> None:
    [line] = errors_of(manifest_data(agent_id=agent_id))
    assert line.startswith("agent_id: must be 1-128 letters, digits, '_' or '-'")
    assert repr(agent_id) in line


@pytest.mark.parametrize("name", ["cap.one", "cap one", "cap*", "cap>", "", "c" * 129])
def test_capability_names_must_be_subject_tokens(name: str) -> None:
    [line] = errors_of(manifest_data(capabilities=[capability_data(name=name)]))
    assert line.startswith("capabilities[0].name: must be 1-128 letters, digits")


def test_agent_name_must_be_a_subject_token() -> None:
    [line] = errors_of(manifest_data(agent_name="report generator"))
    assert line.startswith("agent_name: must be 1-128 letters")


@pytest.mark.parametrize(
    "version", ["0.0.1", "1.2.3", "10.20.30", "1.0.0-alpha", "1.0.0-rc.1", "1.0.0+build.7"]
)
def test_semantic_versions_are_accepted(version: str) -> None:
    assert parse_manifest(manifest_data(version=version)).version == version


@pytest.mark.parametrize("version", ["1", "1.0", "v1.2.3", "01.2.3", "1.2.3.4", "1.2.x", ""])
def test_versions_that_are_not_semver_are_rejected(version: str) -> None:
    [line] = errors_of(manifest_data(version=version))
    assert line == f"version: must be a semantic version like 1.2.3, got {version!r}"


def test_a_yaml_float_version_is_rejected_not_coerced() -> None:
    # `version: 1.0` in YAML is a float; silently turning it into "1.0" would hide the mistake.
    [line] = errors_of(manifest_data(version=1.0))
    assert line.startswith("version: ")


def test_release_versions_are_stable_and_pre_releases_are_not() -> None:
    assert parse_manifest(manifest_data(version="2.3.1")).stable
    assert parse_manifest(manifest_data(version="2.3.1+build-5")).stable
    assert not parse_manifest(manifest_data(version="2.3.1-beta")).stable


def test_capability_version_is_semver_too() -> None:
    [line] = errors_of(manifest_data(capabilities=[capability_data(version="2")]))
    assert line.startswith("capabilities[0].version: must be a semantic version")


@pytest.mark.parametrize("tag", ["data-query", "industry", "report-generate", "l2", "a-b-c"])
def test_lowercase_hyphenated_tags_are_accepted(tag: str) -> None:
    manifest = parse_manifest(manifest_data(capabilities=[capability_data(tags=[tag])]))
    assert manifest.capabilities[0].tags == [tag]


@pytest.mark.parametrize(
    "tag", ["Data-Query", "data_query", "data query", "-data", "data-", "data--query", ""]
)
def test_malformed_tags_are_rejected_with_their_index(tag: str) -> None:
    tags = ["ok", "fine", tag]
    [line] = errors_of(manifest_data(capabilities=[capability_data(tags=tags)]))
    assert line == f"capabilities[0].tags[2]: must be lowercase words joined by '-', got {tag!r}"


def test_error_lines_have_the_documented_path_form() -> None:
    caps = [capability_data(), capability_data(name="second", tags=["ok", "fine", "Bad Tag"])]
    assert errors_of(manifest_data(capabilities=caps)) == [
        "capabilities[1].tags[2]: must be lowercase words joined by '-', got 'Bad Tag'"
    ]


@pytest.mark.parametrize("sla", [0, -1, -0.5])
def test_latency_sla_must_be_positive(sla: float) -> None:
    [line] = errors_of(manifest_data(capabilities=[capability_data(latency_sla_ms=sla)]))
    assert line.startswith("capabilities[0].latency_sla_ms: ")
    assert "greater than 0" in line


def test_qps_must_be_positive_when_given() -> None:
    [line] = errors_of(manifest_data(capabilities=[capability_data(qps=0)]))
    assert line.startswith("capabilities[0].qps: ")


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_security_levels_one_to_four_are_accepted(level: int) -> None:
    manifest = parse_manifest(manifest_data(capabilities=[capability_data(security_level=level)]))
    assert manifest.capabilities[0].security_level == level


@pytest.mark.parametrize("level", [0, 5, -1, "high"])
def test_security_levels_outside_one_to_four_are_rejected(level: object) -> None:
    [line] = errors_of(manifest_data(capabilities=[capability_data(security_level=level)]))
    assert line.startswith("capabilities[0].security_level: ")


@pytest.mark.parametrize("field", ["input_schema", "output_schema"])
@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "nope"}, "at type"),
        ({"type": "object", "required": "name"}, "at required"),
        ({"properties": {"a": {"minimum": "zero"}}}, "at properties/a/minimum"),
    ],
)
def test_invalid_json_schemas_are_rejected(field: str, schema: dict[str, Any], where: str) -> None:
    [line] = errors_of(manifest_data(capabilities=[capability_data(**{field: schema})]))
    assert line.startswith(f"capabilities[0].{field}: not a valid JSON Schema {where}: ")


def test_a_schema_that_is_not_a_mapping_is_rejected() -> None:
    [line] = errors_of(manifest_data(capabilities=[capability_data(input_schema=["string"])]))
    assert line.startswith("capabilities[0].input_schema: ")


def test_valid_json_schemas_are_kept_as_written() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}
    manifest = parse_manifest(manifest_data(capabilities=[capability_data(input_schema=schema)]))
    assert manifest.capabilities[0].input_schema == schema


@pytest.mark.parametrize(
    ("data", "line"),
    [
        (manifest_data(owner="me"), "owner: unknown field"),
        (
            manifest_data(capabilities=[capability_data(timeout=3)]),
            "capabilities[0].timeout: unknown field (did you mean timeout_sec?)",
        ),
        (
            manifest_data(health={"interval": 5}),
            "health.interval: unknown field (did you mean interval_sec?)",
        ),
    ],
)
def test_unknown_fields_are_rejected(data: dict[str, Any], line: str) -> None:
    assert errors_of(data) == [line]


def test_duplicate_capability_names_are_rejected() -> None:
    caps = [capability_data(), capability_data(tags=["other"])]
    assert errors_of(manifest_data(capabilities=caps)) == [
        "capabilities: capability 'generate_report' is declared twice"
    ]


def test_mode_is_sync_or_async() -> None:
    [line] = errors_of(manifest_data(mode="batch"))
    assert line.startswith("mode: ")


def test_a_capability_may_have_a_mode_of_its_own() -> None:
    data = manifest_data()
    data["capabilities"] = [
        {"name": "quick", "security_level": 1},
        {"name": "export", "security_level": 1, "mode": "async"},
    ]
    manifest = Manifest.model_validate(data)
    assert manifest.mode_of("quick") == "sync"
    assert manifest.mode_of("export") == "async"
    assert manifest.runs_jobs
    data["mode"] = "async"
    data["capabilities"][1]["mode"] = "sync"
    flipped = Manifest.model_validate(data)
    assert flipped.mode_of("quick") == "async"
    assert flipped.mode_of("export") == "sync"
    data["mode"] = "sync"
    assert not Manifest.model_validate(data).runs_jobs
    data["capabilities"][1]["mode"] = "batch"
    [line] = errors_of(data)
    assert line.startswith("capabilities[1].mode: ")


@pytest.mark.parametrize(
    ("health", "path"),
    [
        ({"interval_sec": 0}, "health.interval_sec"),
        ({"timeout_sec": -1}, "health.timeout_sec"),
        ({"failures_before_unhealthy": 0}, "health.failures_before_unhealthy"),
    ],
)
def test_health_settings_are_bounded(health: dict[str, Any], path: str) -> None:
    [line] = errors_of(manifest_data(health=health))
    assert line.startswith(f"{path}: ")


def test_every_problem_is_reported_at_once() -> None:
    data = manifest_data(
        version="1.0",
        extra_field=True,
        capabilities=[capability_data(name="a b", security_level=9, tags=["Bad"])],
    )
    lines = errors_of(data)
    assert [line.split(":", 1)[0] for line in lines] == [
        "version",
        "capabilities[0].name",
        "capabilities[0].tags[0]",
        "capabilities[0].security_level",
        "extra_field",
    ]


def test_missing_required_fields_are_named() -> None:
    assert [line.split(":", 1)[0] for line in errors_of({})] == [
        "agent_name",
        "version",
        "capabilities",
    ]


def test_a_manifest_that_is_not_a_mapping_is_reported_at_the_root() -> None:
    [line] = errors_of(["not", "a", "mapping"])
    assert line.startswith("<root>: ")


def test_configuration_error_message_lists_every_line() -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_manifest(manifest_data(version="1"), source="agent.yaml")
    assert str(info.value).startswith("invalid agent.yaml:\n  version: ")
    assert isinstance(info.value, ValueError)


def test_a_manifest_round_trips_through_its_own_dump() -> None:
    manifest = parse_manifest(yaml.safe_load(MANIFEST_EXAMPLE))
    assert Manifest.model_validate(manifest.model_dump(mode="json")) == manifest


# -- latency SLAs and schemas a deadline or a check can follow -------------------------


@pytest.mark.parametrize("sla", [math.inf, math.nan, MAX_SLA_MS * 2, 1e20])
def test_a_latency_sla_that_is_not_finite_or_beyond_a_day_is_refused(sla: float) -> None:
    with pytest.raises(ConfigurationError, match="latency_sla_ms"):
        parse_manifest(manifest_with_sla(sla))


def test_a_latency_sla_of_a_day_is_accepted() -> None:
    manifest = parse_manifest(manifest_with_sla(MAX_SLA_MS))
    assert manifest.capabilities[0].latency_sla_ms == MAX_SLA_MS


@pytest.mark.parametrize("bound", [math.nan, math.inf, -math.inf])
def test_a_schema_holding_nan_or_an_infinity_is_refused_and_says_so(bound: float) -> None:
    with pytest.raises(ConfigurationError, match="NaN or an infinity") as err:
        parse_manifest(manifest_with_schema("nan-1", bound))
    assert any("input_schema" in line for line in err.value.errors)


# -- readiness reasons and details stay small ------------------------------------------


#: the longest reason a record keeps (reach.wire.models.MAX_REASON)
MAX_REASON = 500


def test_reasons_are_clipped_and_details_are_bounded() -> None:
    huge = "x" * 250_000
    readiness = Readiness(ready=False, reason=huge)
    assert len(readiness.reason) == MAX_REASON
    assert readiness.reason.endswith("…")
    assert Readiness(ready=False, reason="short").reason == "short"
    assert len(Readiness(details={huge: huge}).details) == 1
    ((key, value),) = Readiness(details={huge: huge}).details.items()
    assert len(key) == MAX_REASON
    assert isinstance(value, str)
    assert len(value) == MAX_REASON
    assert len(Readiness(details={f"g{i}": i for i in range(32)}).details) == 32
    with pytest.raises(ValidationError):
        Readiness(details={f"g{i}": i for i in range(33)})
    assert len(Transition(at=1.0, status="degraded", reason=huge).reason) == MAX_REASON
    assert len(Bye(agent_id="a-1", instance_id="i", reason=huge).reason) == MAX_REASON
