"""reach.wire.contract: the fast path (jsonschema-rs) never accepts what jsonschema rejects, the
verdict is jsonschema's, errors name the field and rule, and no value crashes a check."""

from __future__ import annotations

import math
import socket
import subprocess
import sys
import urllib.request
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from pydantic import BaseModel, Field

from reach.errors import ConfigurationError, ContractError
from reach.wire import codec
from reach.wire.contract import ROOT, Validator, compile_schema, schema_from_model

REPORT_INPUT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "industry": {"type": "string", "title": "Industry", "description": "which one"},
        "time_range": {"type": "string", "examples": ["2025Q3"]},
        "include_charts": {"type": "boolean", "default": False},
        "items": {
            "type": "array",
            "items": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}},
        },
    },
    "required": ["industry", "time_range"],
}


def fast_verdict(validator: Validator, value: Any) -> bool:
    """Whether the fast path alone accepts ``value`` (it never rejects on its own)."""
    assert validator.fast, f"{validator.schema} should be on the fast path"
    return validator._fast_accepts(value, False)


def json_like(value: Any) -> bool:
    """Whether both JSON and msgpack hold ``value`` as it is."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(map(json_like, value))
    if isinstance(value, dict):
        return all(map(json_like, value.values())) and codec.plain_within(value)
    return codec.plain_within(value)


def error_of(schema: dict[str, Any] | bool, value: Any) -> ContractError:
    with pytest.raises(ContractError) as caught:
        compile_schema(schema).validate(value)
    return caught.value


# --- error messages ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message", "path", "rule"),
    [
        (
            {"industry": "ev", "time_range": "q3", "include_charts": "yes"},
            'include_charts: expected boolean, got "yes"',
            "include_charts",
            "type",
        ),
        ({"time_range": "q3"}, "industry: required property missing", "industry", "required"),
        (
            {"industry": "ev", "time_range": "q3", "items": [{"n": 1}, {}, {"n": -1}]},
            "items[2].n: must be >= 0, got -1",
            "items[2].n",
            "minimum",
        ),
        ([1], "<root>: expected object, got [1]", ROOT, "type"),
    ],
)
def test_errors_name_the_field_and_the_rule(value: Any, message: str, path: str, rule: str) -> None:
    error = error_of(REPORT_INPUT, value)
    assert str(error) == message
    assert error.path == path
    assert error.rule == rule
    assert error.kind == "contract"
    assert not error.retryable


@pytest.mark.parametrize(
    ("schema", "value", "message", "rule"),
    [
        ({"type": ["string", "null"]}, 1.5, "<root>: expected string or null, got 1.5", "type"),
        (
            {"properties": {"a": {"anyOf": [{"type": "string"}, {"type": "null"}]}}},
            {"a": 5},
            "a: expected string or null, got 5",
            "type",
        ),
        ({"type": "string"}, b"xx", "<root>: expected string, got bytes (length 2)", "type"),
        ({"type": "string"}, {"k": 1}, "<root>: expected string, got an object", "type"),
        ({"maximum": 3}, 4, "<root>: must be <= 3, got 4", "maximum"),
        ({"exclusiveMinimum": 0}, 0, "<root>: must be > 0, got 0", "exclusiveMinimum"),
        ({"exclusiveMaximum": 1.5}, 2, "<root>: must be < 1.5, got 2", "exclusiveMaximum"),
        ({"maxLength": 2}, "abcdef", "<root>: must have at most 2 characters, got 6", "maxLength"),
        ({"minItems": 2}, [1], "<root>: must have at least 2 items, got 1", "minItems"),
        (
            {"maxProperties": 1},
            {"a": 1, "b": 2},
            "<root>: must have at most 1 properties, got 2",
            "maxProperties",
        ),
        ({"pattern": "^a+$"}, "b", '<root>: must match pattern "^a+$", got "b"', "pattern"),
        ({"enum": ["x", "y"]}, "z", '<root>: must be one of ["x", "y"], got "z"', "enum"),
        ({"const": 3}, 4, "<root>: must be 3, got 4", "const"),
        (
            {"properties": {"a": {"type": "string"}}, "additionalProperties": False},
            {"a": "x", "zz": 1},
            "zz: unexpected property (additionalProperties is false)",
            "additionalProperties",
        ),
        # jsonschema does not record the path of a value a `false` subschema refused
        (
            {"items": {"anyOf": [False]}},
            [1],
            "[0]: not allowed here (the schema is false)",
            "false",
        ),
        (
            {"properties": {"a b": {"type": "integer"}}},
            {"a b": "x"},
            '["a b"]: expected integer, got "x"',
            "type",
        ),
        (
            {"type": "array", "uniqueItems": True},
            [1, 1],
            "<root>: [1, 1] has non-unique elements",
            "uniqueItems",
        ),
    ],
)
def test_error_wording(schema: dict[str, Any], value: Any, message: str, rule: str) -> None:
    error = error_of(schema, value)
    assert (str(error), error.rule) == (message, rule)


def test_long_values_are_shortened_in_messages() -> None:
    error = error_of({"type": "integer"}, "x" * 10_000)
    assert len(str(error)) < 100


# --- each supported keyword, on the fast path ---------------------------------------

KEYWORD_CASES: list[tuple[dict[str, Any] | bool, list[Any], list[Any]]] = [
    # (schema, valid values, invalid values)
    (True, [None, 1, "x", b"x", {"a": [1]}], []),
    ({}, [None, 1, "x", b"x", {"a": [1]}], []),
    (False, [], [None, 1, "x", {}]),
    ({"type": "null"}, [None], [0, False, "", []]),
    ({"type": "boolean"}, [True, False], [0, 1, None, "true"]),
    ({"type": "integer"}, [0, -5, 2**64, 1.0, -0.0, 2.0**60], [True, 1.5, "1", None, float("inf")]),
    ({"type": "number"}, [0, 1.5, -(2**63), float("nan"), float("inf")], [True, False, "1", None]),
    ({"type": "string"}, ["", "é", "\U0001f600"], [b"x", 1, None, ["a"]]),
    ({"type": "array"}, [[], [1, "a"]], [{}, "ab", None]),
    ({"type": "object"}, [{}, {"a": 1}], [[], None, "a"]),
    ({"type": ["string", "null"]}, ["a", None], [1, False, b"a"]),
    ({"type": ["integer", "boolean"]}, [1, True, 2.0], [1.5, None]),
    (
        {"properties": {"a": {"type": "integer"}}},
        [{}, {"a": 1}, {"b": "x"}, "not an object", 5],
        [{"a": "1"}, {"a": None}],
    ),
    ({"required": ["a", "b"]}, [{"a": 1, "b": None}, [], "ab"], [{}, {"a": 1}]),
    ({"additionalProperties": False}, [{}, 1], [{"a": 1}]),
    (
        {"properties": {"a": True}, "additionalProperties": {"type": "integer"}},
        [{"a": "x", "b": 1}, {}],
        [{"b": "x"}],
    ),
    ({"required": ["a"], "additionalProperties": False}, [[], "x"], [{}, {"a": 1}]),
    ({"items": {"type": "integer"}}, [[], [1, 2.0], {"a": "x"}], [[1, "2"], [None]]),
    ({"items": False}, [[], "x"], [[1]]),
    ({"enum": ["a", "b"]}, ["a", "b"], ["c", b"a", None, 1]),
    (
        {"enum": [1, None, [1, {"k": True}]]},
        [1, 1.0, None, [1.0, {"k": True}]],
        [True, [1, {"k": 1}]],
    ),
    ({"const": False}, [False], [0, 0.0, None, []]),
    ({"const": {"a": [1]}}, [{"a": [1]}, {"a": [1.0]}], [{"a": [True]}, {"a": [1], "b": 1}]),
    ({"minimum": 2.5}, [3, 2.5, "x", None], [2, 2.4]),
    ({"maximum": 2}, [2, 2.0, -1e300], [3, 2.01]),
    ({"exclusiveMinimum": 0}, [1, 1e-300], [0, 0.0, -1]),
    ({"exclusiveMaximum": 0.5}, [0, 0.49], [1, 0.5]),
    ({"type": "integer", "exclusiveMinimum": 0.5, "maximum": 7.5}, [1, 7, 7.0], [0, 8, 0.5, 7.5]),
    ({"type": "number", "maximum": 2**53}, [2**53, float(2**53)], [2**53 + 1]),
    ({"type": "integer", "minimum": -(2**63), "maximum": 2**64 - 1}, [2**64 - 1], [2**64]),
    ({"minLength": 2}, ["ab", "\U0001f600\U0001f600", 1], ["a", "\U0001f600", ""]),
    ({"maxLength": 1}, ["", "é", 12345], ["ab"]),
    ({"pattern": "b\\d"}, ["ab1c", "b2", 12], ["ab", "B1"]),
    ({"pattern": "^a+$"}, ["a", "aaa"], ["ba", "", "ab"]),
    ({"minItems": 1, "maxItems": 2}, [[1], [1, 2], "abc"], [[], [1, 2, 3]]),
    (
        {"minProperties": 1, "maxProperties": 2},
        [{"a": 1}, [1, 2, 3]],
        [{}, {"a": 1, "b": 2, "c": 3}],
    ),
    ({"format": "email", "title": "t", "description": "d", "$comment": "c"}, ["not an email"], []),
    ({"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "string"}, ["a"], [1]),
    ({"anyOf": [{"type": "string"}, {"minimum": 3}]}, ["a", 3, None], [2]),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, [3, 4.0], [2, "a"]),
    (
        {"$defs": {"pos": {"type": "integer", "minimum": 1}}, "items": {"$ref": "#/$defs/pos"}},
        [[1, 2]],
        [[0], ["a"]],
    ),
]


@pytest.mark.parametrize(("schema", "valid", "invalid"), KEYWORD_CASES)
def test_each_supported_keyword_on_the_fast_path(
    schema: dict[str, Any] | bool, valid: list[Any], invalid: list[Any]
) -> None:
    validator = compile_schema(schema)
    assert validator.fast
    reference = Draft202012Validator(schema)
    for value in valid:
        assert reference.is_valid(value), value  # the table itself follows jsonschema
        # values JSON or msgpack cannot hold (NaN, an integer past 64 bits, bytes keys)
        # are left to jsonschema; every other valid value is accepted by the fast path
        assert fast_verdict(validator, value) or not json_like(value), value
        assert validator.is_valid(value)
        validator.validate(value)
    for value in invalid:
        assert not reference.is_valid(value), value
        assert not fast_verdict(validator, value), value
        assert not validator.is_valid(value)
        with pytest.raises(ContractError):
            validator.validate(value)


def test_json_schema_semantics_for_python_values() -> None:
    assert compile_schema({"type": "integer"}).is_valid(1.0)
    assert not compile_schema({"type": "integer"}).is_valid(True)
    assert not compile_schema({"type": "integer"}).is_valid(1.0000000001)
    assert not compile_schema({"type": "number"}).is_valid(True)
    assert not compile_schema({"type": "string"}).is_valid(b"abc")
    assert not compile_schema({"type": "boolean"}).is_valid(1)
    # a tuple travels as a msgpack array: jsonschema-rs takes it for one (jsonschema not)
    assert compile_schema({"type": "array"}).is_valid((1, 2))
    assert not compile_schema({"type": "array", "minItems": 3}).is_valid((1, 2))
    # properties not listed are allowed; required only binds objects
    assert compile_schema({"properties": {"a": {"type": "string"}}}).is_valid({"b": 1})
    assert compile_schema({"required": ["a"]}).is_valid("a string")
    # keywords for one type do not apply to values of another
    assert compile_schema({"minLength": 3}).is_valid(1)
    assert compile_schema({"minimum": 3}).is_valid("a")
    assert compile_schema({"type": ["string", "integer"], "minLength": 3}).is_valid(1)
    assert not compile_schema({"type": ["string", "integer"], "minLength": 3}).is_valid("ab")
    # no coercion, ever
    assert not compile_schema({"type": "integer"}).is_valid("1")
    assert not compile_schema({"type": "number"}).is_valid("1.5")
    # NaN passes bounds, as it does in jsonschema (every comparison with NaN is false)
    assert compile_schema({"type": "number", "minimum": 0}).is_valid(float("nan"))


# --- keywords beyond the common ones: jsonschema-rs checks them too ------------------

MORE_CASES: list[tuple[dict[str, Any], Any, Any, str]] = [
    # (schema, a valid value, an invalid value, the rule it breaks)
    ({"oneOf": [{"type": "integer"}, {"minimum": 0}]}, -1, 1, "oneOf"),
    ({"not": {"type": "string"}}, 1, "a", "not"),
    ({"if": {"type": "integer"}, "then": {"minimum": 0}}, 1, -1, "minimum"),
    ({"uniqueItems": True}, [1, 2], [1, 1.0], "uniqueItems"),
    ({"multipleOf": 3}, 9, 10, "multipleOf"),
    ({"prefixItems": [{"type": "string"}]}, ["a", 1], [1], "type"),
    ({"patternProperties": {"^x": {"type": "integer"}}}, {"xa": 1}, {"xa": "1"}, "type"),
    ({"dependentRequired": {"a": ["b"]}}, {"a": 1, "b": 2}, {"a": 1}, "dependentRequired"),
    ({"contains": {"type": "string"}}, [1, "a"], [1], "contains"),
    ({"propertyNames": {"maxLength": 1}}, {"a": 1}, {"ab": 1}, "maxLength"),
    # a nested $id moves the base URI: "#" is the inner schema, so [[1]] is valid
    ({"type": "array", "items": {"$id": "y", "items": {"$ref": "#"}}}, [[1]], "x", "type"),
]


@pytest.mark.parametrize(("schema", "valid", "invalid", "rule"), MORE_CASES)
def test_every_keyword_is_on_the_fast_path_and_errors_come_from_jsonschema(
    schema: dict[str, Any], valid: Any, invalid: Any, rule: str
) -> None:
    validator = compile_schema(schema)
    assert validator.fast
    assert fast_verdict(validator, valid)
    assert not fast_verdict(validator, invalid)
    assert validator.is_valid(valid)
    validator.validate(valid)
    assert not validator.is_valid(invalid)
    with pytest.raises(ContractError) as caught:
        validator.validate(invalid)
    assert caught.value.rule == rule


def test_remote_refs_are_never_fetched(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a schema made the process open a URL")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    # a real listener too: jsonschema-rs has an HTTP client of its own
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        schema = {"$ref": f"http://127.0.0.1:{listener.getsockname()[1]}/schema.json"}
        validator = compile_schema(schema)
        assert not validator.fast
        assert error_of(schema, 1).rule == "$ref"
        assert not validator.is_valid(1)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected


def test_a_dangling_local_ref_is_a_contract_error() -> None:
    assert error_of({"$ref": "#/$defs/missing"}, 1).rule == "$ref"


# --- refs and pydantic models --------------------------------------------------------


class Line(BaseModel):
    sku: str
    qty: int = Field(ge=1)


class Order(BaseModel):
    customer: str | None = None
    lines: list[Line]
    note: str = Field("", max_length=10)


def test_pydantic_model_schemas_are_on_the_fast_path() -> None:
    validator = compile_schema(schema_from_model(Order))
    assert validator.fast
    good = Order(lines=[Line(sku="a", qty=2)]).model_dump(mode="json")
    validator.validate(good)
    assert fast_verdict(validator, good)
    assert fast_verdict(validator, {"lines": [], "customer": None})
    assert not fast_verdict(validator, {"lines": [{"sku": "a", "qty": 0}]})
    assert str(error_of(validator.schema, {"lines": [{"sku": "a", "qty": 0}]})) == (
        "lines[0].qty: must be >= 1, got 0"
    )
    assert str(error_of(validator.schema, {"lines": [], "customer": 5})) == (
        "customer: expected string or null, got 5"
    )


def test_schema_from_model_modes() -> None:
    assert schema_from_model(Order)["required"] == ["lines"]
    assert "customer" in schema_from_model(Order, mode="serialization")["properties"]


TREE: dict[str, Any] = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "value": {"type": "integer"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
            },
            "required": ["value"],
        }
    },
    "$ref": "#/$defs/node",
}


def test_recursive_refs_are_on_the_fast_path() -> None:
    validator = compile_schema(TREE)
    assert validator.fast
    assert fast_verdict(validator, {"value": 1, "children": [{"value": 2, "children": []}]})
    assert not fast_verdict(validator, {"value": 1, "children": [{"children": []}]})
    assert error_of(TREE, {"value": 1, "children": [{"value": "x"}]}).path == "children[0].value"


def test_a_ref_cycle_that_consumes_nothing_is_checked_without_a_crash() -> None:
    # jsonschema itself recurses until RecursionError on it; jsonschema-rs answers
    schema = {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}
    validator = compile_schema(schema)
    assert validator.is_valid({"any": ["value"]})
    validator.validate(1)


DEEP_CHECK = """
import sys
from reach.wire import codec
from reach.wire.contract import compile_schema
from reach.errors import ContractError
schema = {"$defs": {"n": {"type": ["array", "integer"], "items": {"$ref": "#/$defs/n"}}},
          "$ref": "#/$defs/n"}
validator = compile_schema(schema)
value = 1
for _ in range(200_000):
    value = [value]
print(validator.is_valid(value))
try:
    validator.validate(value)
except ContractError as exc:
    print(exc.rule)
"""


def test_a_value_nested_200000_deep_is_refused_without_a_crash() -> None:
    # jsonschema-rs recurses without a limit (such a value overflows the C stack), so it
    # is never given one; jsonschema's RecursionError becomes a ContractError. In a
    # process of its own: a crash must fail this test, not end the test run.
    done = subprocess.run(
        [sys.executable, "-c", DEEP_CHECK], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "depth"]


# --- compiling and caching ----------------------------------------------------------


def test_the_same_schema_compiles_once() -> None:
    first = compile_schema(REPORT_INPUT)
    reordered = dict(reversed(list(REPORT_INPUT.items())))
    assert compile_schema(reordered) is first
    assert compile_schema({"type": "string"}) is not compile_schema({"type": "integer"})


def test_the_validator_keeps_its_own_copy_of_the_schema() -> None:
    schema: dict[str, Any] = {"type": "object", "properties": {"a": {"type": "string"}}}
    validator = compile_schema(schema)
    schema["properties"]["a"]["type"] = "integer"
    assert validator.is_valid({"a": "x"})
    assert validator.schema == {"type": "object", "properties": {"a": {"type": "string"}}}


def test_an_invalid_schema_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="not a valid JSON Schema at type"):
        compile_schema({"type": "text"})
    with pytest.raises(ConfigurationError, match="minLength"):
        compile_schema({"minLength": -1})
    with pytest.raises(ConfigurationError, match="not JSON"):
        compile_schema({"const": b"bytes"})


# --- property: the verdict is jsonschema's; the fast path never accepts more --------

KEYS = st.sampled_from(["a", "b", "n", "name", "tags", "x y"]) | st.text(max_size=3)
STRINGS = st.sampled_from(["", "a", "ab", "aab", "b1", "B", "é", "\U0001f600x", "a\n"]) | st.text(
    max_size=5
)
NUMBERS = (
    st.integers(-20, 20)
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.integers(-20, 20).map(float)
    | st.floats()
    | st.sampled_from([0.5, -0.0, 2.0**53, 2.0**53 + 2, float(2**63), 1 + 1e-10, float("nan")])
)
# what msgpack can decode, and then some: bytes, NaN, ±inf, integers past 64 bits
VALUES = st.recursive(
    st.none() | st.booleans() | NUMBERS | STRINGS | st.binary(max_size=3),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=12,
)

REPRESENTATIVE: list[dict[str, Any]] = [
    REPORT_INPUT,
    TREE,
    schema_from_model(Order),
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 3, "pattern": "^[a-c]"},
            "tags": {"type": "array", "items": {"enum": ["a", "b", 1, None]}, "maxItems": 3},
            "n": {"type": ["integer", "null"], "minimum": -1, "exclusiveMaximum": 10.5},
        },
        "required": ["name"],
        "additionalProperties": False,
    },
    {
        "properties": {"a": {"type": "number", "exclusiveMinimum": 0, "maximum": 2**53 + 1}},
        "additionalProperties": {"type": ["string", "boolean"]},
        "minProperties": 1,
        "maxProperties": 3,
    },
    {"minLength": 2, "minimum": 0, "items": {"type": "integer"}, "required": ["a"]},
    {"type": "array", "items": {"type": "array", "items": {"const": [1, {"a": None}]}}},
    {"anyOf": [{"type": "string", "pattern": "b$"}, {"type": "integer", "maximum": 0.5}]},
    {"allOf": [{"type": "object"}, {"required": ["n"]}, {"properties": {"n": {"minimum": 0}}}]},
    {"enum": [1, "a", None, True, [1, 2], {"n": 1}, 0.5]},
    {"type": "integer", "minimum": -(2**63), "maximum": 2**64 - 1},
]


@pytest.mark.parametrize("schema", REPRESENTATIVE, ids=lambda s: str(s)[:40])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=VALUES)
def test_fast_verdict_equals_jsonschema_on_representative_schemas(
    schema: dict[str, Any], value: Any
) -> None:
    validator = compile_schema(schema)
    expected = Draft202012Validator(schema).is_valid(value)
    assert validator.is_valid(value) == expected
    assert not fast_verdict(validator, value) or expected


@pytest.mark.parametrize("number", [math.inf, -math.inf, math.nan], ids=str)
def test_infinities_and_nan_are_judged_as_jsonschema_judges_them(number: float) -> None:
    # jsonschema-rs takes them for a JSON null, which "minimum" does not apply to, so it
    # passed -inf against {"minimum": 0, ...} (found by the fuzz test above)
    schema = {"properties": {"n": {"minimum": 0}}, "minimum": 0}
    validator = compile_schema(schema)
    for value in (number, {"n": number}, [number]):
        plain = codec.check_value(value)
        assert not plain
        assert not fast_verdict(validator, value)
        expected = Draft202012Validator(schema).is_valid(value)
        assert validator.is_valid(value, plain=plain) == validator.is_valid(value) == expected
    if number < 0:
        with pytest.raises(ContractError, match="n"):
            validator.validate({"n": number}, plain=codec.check_value({"n": number}))


BOUNDS = st.integers(-5, 5) | st.sampled_from([0.5, -1.5, 2.0, 2**53 + 1, -(2**63), 2**64 - 1])
TYPES = st.sampled_from(["null", "boolean", "integer", "number", "string", "array", "object"])
COUNTS = st.integers(0, 3)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.integers(-3, 3).map(float) | STRINGS,
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(KEYS, inner, max_size=2),
    max_leaves=4,
)


def _extend(child: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.fixed_dictionaries(
        {},
        optional={
            "type": TYPES | st.lists(TYPES, min_size=1, max_size=3, unique=True),
            "enum": st.lists(JSON_VALUES, max_size=3),
            "const": JSON_VALUES,
            "minimum": BOUNDS,
            "maximum": BOUNDS,
            "exclusiveMinimum": BOUNDS,
            "exclusiveMaximum": BOUNDS,
            "minLength": COUNTS,
            "maxLength": COUNTS,
            "pattern": st.sampled_from(["^a", "b$", "a+", "^$", "\\d", "(?i)B", "^[a-c]*$"]),
            "items": child,
            "minItems": COUNTS,
            "maxItems": COUNTS,
            "properties": st.dictionaries(KEYS, child, max_size=3),
            "required": st.lists(KEYS, max_size=2, unique=True),
            "additionalProperties": child,
            "minProperties": COUNTS,
            "maxProperties": COUNTS,
            "anyOf": st.lists(child, min_size=1, max_size=2),
            "allOf": st.lists(child, min_size=1, max_size=2),
            "description": st.just("annotation only"),
        },
    )


SCHEMAS = st.recursive(
    st.booleans() | st.fixed_dictionaries({"type": TYPES}), _extend, max_leaves=6
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=SCHEMAS, values=st.lists(VALUES, min_size=1, max_size=5))
def test_fast_verdict_equals_jsonschema_on_generated_schemas(
    schema: dict[str, Any] | bool, values: list[Any]
) -> None:
    validator = compile_schema(schema)
    reference = Draft202012Validator(schema)
    for value in values:
        expected = reference.is_valid(value)
        assert validator.is_valid(value) == expected
        assert not validator.fast or not fast_verdict(validator, value) or expected
