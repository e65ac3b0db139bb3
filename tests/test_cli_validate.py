"""``reach validate FILE`` and ``reach schema export DIR`` driven through the real CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner, Result

from reach.cli import main
from reach.errors import ConfigurationError
from reach.wire.models import parse_manifest
from reach.wire.schemas import WIRE_SCHEMAS

from .manifest_helpers import MANIFEST_EXAMPLE

BAD_MANIFEST = """\
agent_name: report_generator
version: "1.0"
surprise: true
capabilities:
  - name: generate report
    tags: [report-generate, industry, Bad Tag]
    latency_sla_ms: 0
    security_level: 7
    input_schema: {type: nope}
"""


def reach(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def write(tmp_path: Path, text: str, name: str = "agent.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_a_valid_manifest_prints_ok_and_exits_zero(tmp_path: Path) -> None:
    result = reach("validate", str(write(tmp_path, MANIFEST_EXAMPLE)))
    assert result.exit_code == 0, result.output
    assert result.stdout == "OK: agent-report-gen-001 (1 capability)\n"


def test_capabilities_are_counted(tmp_path: Path) -> None:
    text = "agent_id: a1\nagent_name: a\nversion: 1.0.0\ncapabilities: [{name: x}, {name: y}]\n"
    result = reach("validate", str(write(tmp_path, text)))
    assert result.exit_code == 0, result.output
    assert result.stdout == "OK: a1 (2 capabilities)\n"


def test_a_manifest_without_agent_id_shows_the_rule_not_a_random_id(tmp_path: Path) -> None:
    # a random id printed here would not be the one the agent draws when it starts
    text = "agent_name: tiny\nversion: 0.1.0\ncapabilities: [{name: x}]\n"
    result = reach("validate", str(write(tmp_path, text)))
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        "OK: tiny-<8 random hex digits> (1 capability); each start of the agent draws"
        " a new agent_id (set agent_id to keep one)\n"
    )


def test_a_number_written_as_text_is_refused_naming_the_field(tmp_path: Path) -> None:
    text = (
        "agent_name: a\nversion: 1.0.0\n"
        'capabilities: [{name: x, security_level: "2"}]\nhealth: {interval_sec: "5"}\n'
    )
    result = reach("validate", str(write(tmp_path, text)))
    assert result.exit_code == 1
    assert result.stdout.splitlines() == [
        "capabilities[0].security_level: Input should be a valid integer, got the text '2'",
        "health.interval_sec: Input should be a valid number, got the text '5'",
    ]
    # as a YAML float for a version is
    text = "agent_name: a\nversion: 1.0\ncapabilities: [{name: x}]\n"
    result = reach("validate", str(write(tmp_path, text)))
    assert result.stdout == "version: Input should be a valid string, got the number 1.0\n"


def test_every_error_is_printed_with_its_path_and_exit_code_is_one(tmp_path: Path) -> None:
    path = write(tmp_path, BAD_MANIFEST)
    result = reach("validate", str(path))
    assert result.exit_code == 1
    assert result.stdout.splitlines() == [
        "version: must be a semantic version like 1.2.3, got '1.0'",
        "capabilities[0].name: must be 1-128 letters, digits, '_' or '-'"
        " (a NATS subject token), got 'generate report'",
        "capabilities[0].input_schema: not a valid JSON Schema at type:"
        " 'nope' is not valid under any of the given schemas",
        "capabilities[0].tags[2]: must be lowercase words joined by '-', got 'Bad Tag'",
        "capabilities[0].latency_sla_ms: Input should be greater than 0",
        "capabilities[0].security_level: Input should be less than or equal to 4",
        "surprise: unknown field",
    ]
    assert result.stderr == f"error: {path}: invalid manifest, 7 problems\n"


def test_a_single_problem_is_reported_in_the_singular(tmp_path: Path) -> None:
    text = "agent_name: a\nversion: '1'\ncapabilities: [{name: x}]\n"
    result = reach("validate", str(write(tmp_path, text)))
    assert result.exit_code == 1
    assert result.stderr.endswith("invalid manifest, 1 problem\n")


def test_duplicate_capabilities_are_reported(tmp_path: Path) -> None:
    text = "agent_name: a\nversion: 1.0.0\ncapabilities: [{name: x}, {name: x}]\n"
    result = reach("validate", str(write(tmp_path, text)))
    assert result.exit_code == 1
    assert result.stdout == "capabilities: capability 'x' is declared twice\n"


def test_a_yaml_syntax_error_is_one_line_with_its_position(tmp_path: Path) -> None:
    path = write(tmp_path, "agent_name: a\nversion: 1.0.0\ncapabilities: [ {name: x\n")
    result = reach("validate", str(path))
    assert result.exit_code == 1
    assert result.stdout == ""
    assert re.fullmatch(
        rf"error: {re.escape(str(path))}:\d+:\d+: YAML syntax error: .+\n", result.stderr
    )


def test_a_tab_indented_yaml_file_is_a_syntax_error(tmp_path: Path) -> None:
    path = write(tmp_path, "agent_name: a\nhealth:\n\tinterval_sec: 5\n")
    result = reach("validate", str(path))
    assert result.exit_code == 1
    assert "YAML syntax error" in result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_a_missing_file_is_one_clear_line(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    result = reach("validate", str(path))
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr == f"error: {path}: no such file\n"


def test_a_directory_is_not_a_manifest(tmp_path: Path) -> None:
    result = reach("validate", str(tmp_path))
    assert result.exit_code == 1
    assert result.stderr == f"error: {tmp_path}: is a directory, not a manifest file\n"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty file, expected a manifest"),
        ("# only a comment\n", "empty file, expected a manifest"),
        ("- agent_name: a\n", "a manifest is a YAML mapping, got a list"),
        ("just words\n", "a manifest is a YAML mapping, got a str"),
    ],
)
def test_a_file_that_is_not_a_mapping_is_one_clear_line(
    tmp_path: Path, text: str, reason: str
) -> None:
    path = write(tmp_path, text)
    result = reach("validate", str(path))
    assert result.exit_code == 1
    assert result.stderr == f"error: {path}: {reason}\n"


def test_a_file_that_is_not_utf8_is_one_clear_line(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_bytes(b"agent_name: \xff\xfe\n")
    result = reach("validate", str(path))
    assert result.exit_code == 1
    assert result.stderr == f"error: {path}: not UTF-8 text\n"


def test_validate_accepts_the_connection_options(tmp_path: Path) -> None:
    path = write(tmp_path, MANIFEST_EXAMPLE)
    result = reach(
        "validate", str(path), "--servers", "nats://127.0.0.1:1", "--creds", "missing.creds"
    )
    assert result.exit_code == 0, result.output


def test_schema_export_writes_every_schema(tmp_path: Path) -> None:
    target = tmp_path / "out" / "schemas"
    result = reach("schema", "export", str(target), "--servers", "nats://x:1", "--creds", "c")
    assert result.exit_code == 0, result.output
    written = sorted(path.name for path in target.iterdir())
    assert written == sorted(entry.filename for entry in WIRE_SCHEMAS)
    assert result.stdout.splitlines() == [str(target / e.filename) for e in WIRE_SCHEMAS]
    assert f"wrote {len(WIRE_SCHEMAS)} schemas" in result.stderr


def test_schema_export_output_matches_the_committed_files(tmp_path: Path) -> None:
    assert reach("schema", "export", str(tmp_path)).exit_code == 0
    committed = Path(__file__).resolve().parents[1] / "schemas"
    for entry in WIRE_SCHEMAS:
        assert (tmp_path / entry.filename).read_bytes() == (committed / entry.filename).read_bytes()


def test_schema_export_into_a_file_fails_with_one_line(tmp_path: Path) -> None:
    blocker = write(tmp_path, "not a directory", name="file")
    result = reach("schema", "export", str(blocker / "sub"))
    assert result.exit_code == 1
    assert result.stderr.startswith(f"error: {blocker / 'sub'}: cannot write schemas: ")
    assert len(result.stderr.splitlines()) == 1


# -- identifiers with a trailing newline -----------------------------------------------


VALID = {
    "agent_id": "agent-1",
    "agent_name": "report",
    "version": "1.0.0",
    "name": "echo",
    "tag": "data-query",
}


def manifest_yaml(**values: str) -> str:
    """A manifest file; JSON strings are YAML double-quoted scalars ("\\n" a newline)."""
    v = {k: json.dumps(value) for k, value in {**VALID, **values}.items()}
    return (
        f"agent_id: {v['agent_id']}\n"
        f"agent_name: {v['agent_name']}\n"
        f"version: {v['version']}\n"
        "capabilities:\n"
        f"  - name: {v['name']}\n"
        f"    tags: [{v['tag']}]\n"
        "    security_level: 1\n"
    )


@pytest.mark.parametrize(
    ("field", "path"),
    [
        ("agent_id", "agent_id"),
        ("agent_name", "agent_name"),
        ("version", "version"),
        ("name", "capabilities[0].name"),
        ("tag", "capabilities[0].tags[0]"),
    ],
)
def test_validate_refuses_an_identifier_with_a_trailing_newline(
    tmp_path: Path, field: str, path: str
) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(manifest_yaml(), encoding="utf-8")
    result = CliRunner().invoke(main, ["validate", str(good)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    bad = tmp_path / "bad.yaml"
    text = manifest_yaml(**{field: VALID[field] + "\n"})
    bad.write_text(text, encoding="utf-8")
    result = CliRunner().invoke(main, ["validate", str(bad)], catch_exceptions=False)
    assert result.exit_code == 1, result.output
    assert result.stdout.splitlines()[0].startswith(f"{path}: must be")
    assert result.stderr.endswith("invalid manifest, 1 problem\n")
    data = yaml.safe_load(text)
    cap = data["capabilities"][0]
    loaded = {**data, "name": cap["name"], "tag": cap["tags"][0]}
    assert loaded[field] == VALID[field] + "\n"  # the YAML escape is read as a newline
    with pytest.raises(ConfigurationError):
        parse_manifest(data)


def test_one_run_lists_every_problem_with_a_suggestion_for_a_typo(tmp_path: Path) -> None:
    """A duplicate capability is said beside a problem inside one, and a mistyped field
    is answered with the field it is close to."""
    text = (
        "agent_name: a\nversion: 1.0.0\nmax_concurency: 5\n"
        "capabilities: [{name: x, security_level: 9}, {name: x}]\n"
    )
    result = reach("validate", str(write(tmp_path, text)))
    assert result.exit_code == 1
    assert result.stdout.splitlines() == [
        "capabilities[0].security_level: Input should be less than or equal to 4",
        "max_concurency: unknown field (did you mean max_concurrency?)",
        "capabilities: capability 'x' is declared twice",
    ]


def test_a_manifest_without_capabilities_is_refused(tmp_path: Path) -> None:
    for text in (
        "agent_name: a\nversion: 1.0.0\ncapabilities: []\n",
        "agent_name: a\nversion: 1.0.0\n",
    ):
        result = reach("validate", str(write(tmp_path, text)))
        assert result.exit_code == 1
        assert result.stdout.startswith("capabilities: "), result.stdout


def test_a_contract_that_refers_to_another_document_is_refused(tmp_path: Path) -> None:
    """It is never fetched: the agent would start, and every call fail its contract."""
    text = (
        "agent_name: a\nversion: 1.0.0\ncapabilities:\n  - name: x\n"
        "    input_schema: {$ref: 'https://example.com/order.json'}\n"
    )
    result = reach("validate", str(write(tmp_path, text)))
    assert result.exit_code == 1
    assert "capabilities[0].input_schema: not a valid contract" in result.stdout
    assert "https://example.com/order.json" in result.stdout
    local = (
        "agent_name: a\nversion: 1.0.0\ncapabilities:\n  - name: x\n"
        "    input_schema: {$ref: '#/$defs/order', $defs: {order: {type: object}}}\n"
    )
    assert reach("validate", str(write(tmp_path, local))).exit_code == 0
