"""schemas/ stays in step with the code, and the envelope models match the real envelope."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, get_args

import msgpack
import pytest
import yaml
from jsonschema import Draft202012Validator
from pydantic import BaseModel, ValidationError

from reach.wire import envelope
from reach.wire.envelope import RequestMeta
from reach.wire.schemas import (
    JSON_SCHEMA_DIALECT,
    SCHEMA_BASE_URL,
    WIRE_SCHEMAS,
    EnvelopeError,
    ErrorKind,
    ReplyEnvelope,
    RequestEnvelope,
    export_schemas,
    render_schema,
)

from .manifest_helpers import MANIFEST_EXAMPLE
from .schema_helpers import SCHEMAS_DIR, load_schema

REGENERATE = "run `reach schema export schemas` (or `make schemas`) and commit the result"


def wire_keys(model: type[BaseModel]) -> set[str]:
    return {field.alias or name for name, field in model.model_fields.items()}


def unpacked(data: bytes) -> dict[str, Any]:
    value = msgpack.unpackb(data, raw=False)
    assert isinstance(value, dict)
    return value


# -- drift -----------------------------------------------------------------------------


def test_committed_schemas_match_the_code_byte_for_byte(tmp_path: Path) -> None:
    export_schemas(tmp_path)
    for fresh in sorted(tmp_path.iterdir()):
        committed = SCHEMAS_DIR / fresh.name
        assert committed.exists(), f"schemas/{fresh.name} is missing: {REGENERATE}"
        assert committed.read_bytes() == fresh.read_bytes(), (
            f"schemas/{fresh.name} is out of date: {REGENERATE}"
        )


def test_no_stale_schema_files_are_left_behind(tmp_path: Path) -> None:
    expected = {path.name for path in export_schemas(tmp_path)}
    present = {path.name for path in SCHEMAS_DIR.glob("*.json")}
    assert present - expected == set(), "delete stale files from schemas/ (no model makes them)"
    assert {path.name for path in SCHEMAS_DIR.iterdir()} == expected | {"README.md"}


def test_the_readme_describes_every_schema_file() -> None:
    readme = (SCHEMAS_DIR / "README.md").read_text(encoding="utf-8")
    for entry in WIRE_SCHEMAS:
        assert f"`{entry.filename}`" in readme


def test_export_returns_the_paths_it_wrote_and_is_repeatable(tmp_path: Path) -> None:
    first = export_schemas(tmp_path / "a" / "b")
    assert [path.name for path in first] == [entry.filename for entry in WIRE_SCHEMAS]
    before = [path.read_bytes() for path in first]
    assert [path.read_bytes() for path in export_schemas(tmp_path / "a" / "b")] == before


# -- shape of every file ---------------------------------------------------------------


@pytest.mark.parametrize("entry", WIRE_SCHEMAS, ids=lambda entry: entry.name)
def test_every_schema_is_a_valid_draft_2020_12_schema_with_an_id(entry: Any) -> None:
    text = render_schema(entry)
    schema = json.loads(text)
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == JSON_SCHEMA_DIALECT
    assert schema["$id"] == f"{SCHEMA_BASE_URL}{entry.name}.schema.json"
    assert schema["description"]
    assert text == json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def test_file_names_are_unique() -> None:
    names = [entry.filename for entry in WIRE_SCHEMAS]
    assert len(names) == len(set(names))
    assert "manifest.schema.json" in names
    assert "instance.schema.json" in names
    assert "heartbeat.schema.json" in names


# -- the manifest schema says what the model says --------------------------------------


def test_the_annotated_example_is_valid_against_the_manifest_schema() -> None:
    validator = Draft202012Validator(load_schema("manifest"))
    assert list(validator.iter_errors(yaml.safe_load(MANIFEST_EXAMPLE))) == []


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"agent_id": "a.b"}, "agent_id"),
        ({"version": "1.0"}, "version"),
        ({"unknown": 1}, ""),
        ({"capabilities": [{"name": "x", "tags": ["Bad Tag"]}]}, "capabilities/0/tags/0"),
        ({"capabilities": [{"name": "x", "security_level": 5}]}, "capabilities/0/security_level"),
        ({"capabilities": [{"name": "x", "latency_sla_ms": 0}]}, "capabilities/0/latency_sla_ms"),
        ({"capabilities": [{"name": "x y"}]}, "capabilities/0/name"),
    ],
)
def test_the_manifest_schema_rejects_what_the_model_rejects(
    change: dict[str, Any], where: str
) -> None:
    data = {**yaml.safe_load(MANIFEST_EXAMPLE), **change}
    errors = list(Draft202012Validator(load_schema("manifest")).iter_errors(data))
    assert ["/".join(str(p) for p in error.absolute_path) for error in errors] == [where]


# -- envelope models mirror reach/wire/envelope.py ------------------------------------------

FULL_META = RequestMeta(
    call_id="call-1",
    token="tok",
    deadline_ms=1_760_000_000_000,
    idempotency_key="idem-1",
    attempt=2,
    traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    tracestate="vendor=1",
    caller="agent-a",
    audit=True,
)


def test_request_envelope_keys_match_pack_request() -> None:
    full = unpacked(envelope.pack_request(FULL_META, b"\x80"))
    minimal = unpacked(envelope.pack_request(RequestMeta(call_id="call-2"), b""))
    assert set(full) == wire_keys(RequestEnvelope)
    assert set(minimal) == {"v", "id", "b"}
    assert set(load_schema("request-envelope")["properties"]) == set(full)
    assert set(load_schema("request-envelope")["required"]) == {"v", "id"}


def test_reply_envelope_keys_match_pack_ok_and_pack_error() -> None:
    ok = unpacked(envelope.pack_ok(b"\x80", by="inst-1", job="job-1", audited=True))
    error = unpacked(envelope.pack_error("contract", "type", "n: bad", by="inst-1", path="n"))
    assert set(ok) == {"v", "ok", "b", "by", "job", "aud"}
    assert set(error) == {"v", "ok", "err", "by"}
    assert set(ok) | set(error) == wire_keys(ReplyEnvelope)
    assert set(error["err"]) == wire_keys(EnvelopeError)
    assert set(load_schema("reply-envelope")["properties"]) == set(ok) | set(error)


def test_error_kinds_match_the_envelope() -> None:
    assert set(get_args(ErrorKind)) == envelope.ERROR_KINDS


def test_real_envelopes_validate_against_the_models() -> None:
    request = RequestEnvelope.model_validate(unpacked(envelope.pack_request(FULL_META, b"\x80")))
    assert request.from_ == "agent-a"
    assert request.dl == FULL_META.deadline_ms
    RequestEnvelope.model_validate(unpacked(envelope.pack_request(RequestMeta("c"), b"")))
    assert ReplyEnvelope.model_validate(unpacked(envelope.pack_ok(b"\x80"))).b == b"\x80"
    failed = ReplyEnvelope.model_validate(unpacked(envelope.pack_error("timeout", "late", "")))
    assert failed.err is not None
    assert failed.err.kind == "timeout"


def test_reply_envelope_model_requires_err_when_not_ok() -> None:
    with pytest.raises(ValidationError, match="must carry 'err'"):
        ReplyEnvelope.model_validate({"v": 1, "ok": False})
    validator = Draft202012Validator(load_schema("reply-envelope"))
    assert not validator.is_valid({"v": 1, "ok": False})
    assert validator.is_valid({"v": 1, "ok": False, "err": {"kind": "business"}})
    assert validator.is_valid({"v": 1, "ok": True})


def test_optional_envelope_keys_are_not_nullable_in_the_schema() -> None:
    # pack_request omits unset keys rather than sending nil; the schema says the same.
    properties = load_schema("request-envelope")["properties"]
    for key in ("tok", "dl", "ik", "tp", "ts", "from"):
        assert "default" not in properties[key]
        assert "anyOf" not in properties[key]
