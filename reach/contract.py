"""Payload contracts: JSON Schema checks fast enough for the call hot path.

``compile_schema`` turns a capability's ``input_schema``/``output_schema`` into a
``Validator`` once. A supported subset of Draft 2020-12 is translated into a
pydantic-core schema and answered in about a microsecond; any other schema runs on
jsonschema's ``Draft202012Validator`` (tens of microseconds). Either way jsonschema
has the last word and words the error, and it only runs when a payload fails::

    validator = compile_schema(capability.input_schema)   # once, cached by canonical JSON
    validator.validate(payload)   # ContractError("items[2].n: must be >= 0, got -1")

Schemas arrive over the network, so nothing here generates or executes Python code
from them: a pydantic-core schema is data interpreted by Rust, and the few checks
pydantic-core cannot express are fixed functions of this module parameterised by
the schema's values. Remote ``$ref``s are never fetched.

Fast subset: ``type`` (one or a list, ``"null"`` included), ``properties``,
``required``, ``additionalProperties``, ``items``, ``enum``, ``const``, ``minimum``,
``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum``, ``minLength``, ``maxLength``,
``pattern``, ``minItems``, ``maxItems``, ``minProperties``, ``maxProperties``,
``allOf``, ``anyOf``, ``$ref`` to a JSON pointer inside the same schema (``#/$defs/X``,
as pydantic's ``model_json_schema`` writes them), and the keywords that do not assert
(``title``, ``description``, ``default``, ``examples``, ``format``, ``$comment``, …).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, cast
from urllib.parse import unquote

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, ValidationError, best_match
from pydantic import BaseModel
from pydantic_core import PydanticCustomError, SchemaValidator
from pydantic_core import core_schema as cs
from referencing import Registry
from referencing.exceptions import Unresolvable

from reach.errors import ConfigurationError, ContractError

__all__ = ["ROOT", "Validator", "compile_schema", "schema_from_model"]

#: how an error at the top of the payload names its field
ROOT = "<root>"

_CACHE_SIZE = 512
_DRAFT_2020_12 = frozenset(
    {
        "https://json-schema.org/draft/2020-12/schema",
        "https://json-schema.org/draft/2020-12/schema#",
    }
)
# Every keyword jsonschema acts on; those outside the fast subset send a schema to the
# slow path. Keywords jsonschema ignores ($defs, title, x-anything, …) are ignored here too.
_FAST_KEYWORDS = frozenset(
    {
        "type",
        "enum",
        "const",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "minLength",
        "maxLength",
        "pattern",
        "items",
        "minItems",
        "maxItems",
        "properties",
        "required",
        "additionalProperties",
        "minProperties",
        "maxProperties",
        "allOf",
        "anyOf",
        "$ref",
        "format",  # an annotation unless a format checker is configured, and none is
    }
)
_SLOW_KEYWORDS = frozenset(Draft202012Validator.VALIDATORS) - _FAST_KEYWORDS

# The JSON kinds of value; "integer" is a "number" with a whole value.
_KINDS = ("null", "boolean", "number", "string", "array", "object")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_KIND_KEYWORDS: dict[str, tuple[str, ...]] = {
    "null": (),
    "boolean": (),
    "number": _BOUNDS,
    "string": ("minLength", "maxLength", "pattern"),
    "array": ("items", "minItems", "maxItems"),
    "object": ("properties", "required", "additionalProperties", "minProperties", "maxProperties"),
}
_MAX_EXACT_FLOAT_INT = 2**53
_SIMPLE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_SHOW_MAX = 60
_MESSAGE_MAX = 300


class Validator:
    """A compiled schema: ``validate`` raises ``ContractError``, ``is_valid`` answers yes/no.

    Build it with ``compile_schema``; keep it for as long as the schema lives.
    """

    __slots__ = ("_fast", "_slow", "schema")

    def __init__(self, schema: dict[str, Any] | bool) -> None:
        #: the schema as compiled (a private copy; changing the caller's dict changes nothing)
        self.schema = schema
        # An empty registry: jsonschema's default one downloads remote $refs over HTTP.
        self._slow = Draft202012Validator(schema, registry=Registry())
        self._fast: Callable[[Any], bool] | None = _fast_check(schema)

    @property
    def fast(self) -> bool:
        """Whether valid payloads are confirmed by pydantic-core rather than jsonschema."""
        return self._fast is not None

    def is_valid(self, value: Any) -> bool:
        """Whether ``value`` (as msgpack decodes it) matches the schema."""
        fast = self._fast
        if fast is not None:
            try:
                if fast(value):
                    return True
            except Exception:  # the fast path must never decide a failure on its own
                pass
        try:
            return bool(self._slow.is_valid(value))
        except Unresolvable:
            return False

    def validate(self, value: Any) -> None:
        """Raise ``ContractError`` naming the field and the rule if ``value`` does not match."""
        fast = self._fast
        if fast is not None:
            try:
                if fast(value):
                    return
            except Exception:  # fall through: jsonschema decides and explains
                pass
        try:
            error = best_match(self._slow.iter_errors(value))
        except Unresolvable as exc:
            raise ContractError(
                f"{ROOT}: the schema has a $ref that cannot be resolved: {exc}",
                path=ROOT,
                rule="$ref",
            ) from None
        if error is not None:
            raise _contract_error(error) from None

    def __repr__(self) -> str:
        path = "fast" if self._fast is not None else "slow"
        return f"<Validator {path} {_truncate(json.dumps(self.schema), _SHOW_MAX)}>"


def compile_schema(schema: Mapping[str, Any] | bool) -> Validator:
    """Compile a JSON Schema (Draft 2020-12) once; the same schema returns the same Validator.

    Schemas are compared by canonical JSON, and the most recently used few hundred are
    kept. Compiling costs far more than validating: call this when a capability is
    registered or first called, not on every call. A schema that is not JSON or not a
    valid JSON Schema raises ``ConfigurationError``.
    """
    try:
        key = json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"not a JSON Schema: the schema is not JSON ({exc})") from None
    return _compile(key)


def schema_from_model(
    model: type[BaseModel], *, mode: Literal["validation", "serialization"] = "validation"
) -> dict[str, Any]:
    """The JSON Schema of a pydantic model: ``validation`` for what it accepts (handler input),
    ``serialization`` for what ``model_dump(mode="json")`` produces (handler output)."""
    return model.model_json_schema(mode=mode)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _compile(canonical: str) -> Validator:
    schema = json.loads(canonical)
    if not isinstance(schema, dict | bool):
        raise ConfigurationError(
            f"not a JSON Schema: expected an object or a boolean, got {_show(schema)}"
        )
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = _path(exc.absolute_path)
        raise ConfigurationError(f"not a valid JSON Schema at {where}: {exc.message}") from None
    return Validator(schema)


# ---------------------------------------------------------------------------------------
# The fast path: JSON Schema → pydantic-core schema


class _Unsupported(Exception):
    """The schema needs something the fast path does not translate."""


def _fast_check(schema: dict[str, Any] | bool) -> Callable[[Any], bool] | None:
    if schema is True or schema == {}:
        return _accept
    try:
        core = _Translator(schema).build()
        return SchemaValidator(core).isinstance_python
    except Exception:  # _Unsupported, or a value pydantic-core cannot hold (a huge bound)
        return None


def _accept(value: Any) -> bool:
    return True


class _Nothing:
    """No payload is ever an instance of this: the core schema of ``false``."""


def _never() -> cs.CoreSchema:
    return cs.is_instance_schema(_Nothing)


def _reject() -> PydanticCustomError:
    return PydanticCustomError("contract", "does not match the schema")


class _Translator:
    """Translates one schema; each ``$ref`` target becomes a pydantic-core definition."""

    def __init__(self, root: dict[str, Any] | bool) -> None:
        self._root = root
        self._definitions: dict[str, cs.CoreSchema] = {}
        self._started: set[str] = set()
        # refs entered since the payload was last descended into: meeting one of these
        # again is a cycle that never consumes input, which jsonschema cannot finish either
        self._unguarded: set[str] = set()

    def build(self) -> cs.CoreSchema:
        core = self.schema(self._root, root=True)
        if self._definitions:
            core = cs.definitions_schema(core, list(self._definitions.values()))
        return core

    def schema(self, schema: Any, *, root: bool = False) -> cs.CoreSchema:
        if schema is True:
            return cs.any_schema()
        if schema is False:
            return _never()
        if not isinstance(schema, dict):
            raise _Unsupported("not a schema")
        if not _SLOW_KEYWORDS.isdisjoint(schema):
            raise _Unsupported("keyword outside the fast subset")
        # another $schema may switch jsonschema to another draft; a nested $id moves the base URI
        if "$schema" in schema and (not root or schema["$schema"] not in _DRAFT_2020_12):
            raise _Unsupported("$schema")
        if "$id" in schema and not root:
            raise _Unsupported("nested $id")
        # all of these must hold: cheap yes/no checks first
        steps: list[cs.CoreSchema] = []
        if "enum" in schema:
            steps.append(_one_of_values(schema["enum"]))
        if "const" in schema:
            steps.append(_one_of_values([schema["const"]]))
        typed = self._typed(schema)
        if typed is not None:
            steps.append(typed)
        if "$ref" in schema:
            steps.append(self._ref(schema["$ref"]))
        steps.extend(self.schema(sub) for sub in schema.get("allOf", ()))
        if "anyOf" in schema:
            steps.append(_union([self.schema(sub) for sub in schema["anyOf"]]))
        if not steps:
            return cs.any_schema()
        # a step's output is an equal copy of its input, so a chain is an intersection
        return steps[0] if len(steps) == 1 else cs.chain_schema(steps)

    def _descend(self, schema: Any) -> cs.CoreSchema:
        """Translate the schema of a part of the payload (a property, an item)."""
        saved, self._unguarded = self._unguarded, set()
        try:
            return self.schema(schema)
        finally:
            self._unguarded = saved

    def _ref(self, ref: Any) -> cs.CoreSchema:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise _Unsupported("only JSON pointers into the same schema")
        name = ref
        if name in self._unguarded:
            raise _Unsupported("reference cycle")
        if name not in self._started:
            self._started.add(name)
            target = _resolve_pointer(self._root, ref[1:])
            self._unguarded.add(name)
            try:
                core = self.schema(target, root=ref == "#")
            finally:
                self._unguarded.discard(name)
            self._definitions[name] = cast(cs.CoreSchema, {**core, "ref": name})
        return cs.definition_reference_schema(name)

    def _typed(self, schema: dict[str, Any]) -> cs.CoreSchema | None:
        """The type and the keywords that apply to one kind of value only."""
        declared = schema.get("type")
        if declared is None:
            kinds = [k for k in _KINDS if any(kw in schema for kw in _KIND_KEYWORDS[k])]
            if not kinds:
                return None
            # keywords of one kind do not constrain values of the others
            others = cs.no_info_plain_validator_function(_not_of_kinds(frozenset(kinds)))
            return _union([*(self._kind(k, schema, whole=False) for k in kinds), others])
        names = [declared] if isinstance(declared, str) else list(declared)
        branches = []
        for kind in _KINDS:
            if kind == "number" and "number" not in names:
                if "integer" in names:
                    branches.append(self._kind("number", schema, whole=True))
            elif kind in names:
                branches.append(self._kind(kind, schema, whole=False))
        return _union(branches)

    def _kind(self, kind: str, schema: dict[str, Any], *, whole: bool) -> cs.CoreSchema:
        if kind == "null":
            return cs.none_schema()
        if kind == "boolean":
            return cs.bool_schema(strict=True)
        if kind == "number":
            return _number(schema, whole=whole)
        if kind == "string":
            pattern = schema.get("pattern")
            return cs.str_schema(
                strict=True,
                min_length=_count(schema.get("minLength")),
                max_length=_count(schema.get("maxLength")),
                # Python's re.search, as jsonschema uses: unanchored, same dialect
                pattern=pattern,
                regex_engine="python-re" if pattern is not None else None,
            )
        if kind == "array":
            if not any(kw in schema for kw in _KIND_KEYWORDS["array"]):
                return cs.is_instance_schema(list)  # no copy
            return cs.list_schema(
                self._descend(schema.get("items", True)),
                strict=True,
                min_length=_count(schema.get("minItems")),
                max_length=_count(schema.get("maxItems")),
            )
        return self._object(schema)

    def _object(self, schema: dict[str, Any]) -> cs.CoreSchema:
        properties: dict[str, Any] = schema.get("properties", {})
        required: list[str] = schema.get("required", [])
        additional = schema.get("additionalProperties", True)
        steps: list[cs.CoreSchema] = []
        min_size = _count(schema.get("minProperties"))
        max_size = _count(schema.get("maxProperties"))
        if min_size is not None or max_size is not None:
            steps.append(cs.dict_schema(strict=True, min_length=min_size, max_length=max_size))
        if properties or required or additional is not True:
            fields = {
                name: cs.typed_dict_field(self._descend(sub), required=name in required)
                for name, sub in properties.items()
            }
            for name in required:
                # a required property that is not listed is still an "additional" one
                if name not in fields:
                    fields[name] = cs.typed_dict_field(self._descend(additional), required=True)
            steps.append(
                cs.typed_dict_schema(
                    fields,
                    strict=True,
                    extra_behavior="forbid" if additional is False else "allow",
                    extras_schema=None
                    if isinstance(additional, bool)
                    else self._descend(additional),
                )
            )
        if not steps:
            return cs.is_instance_schema(dict)  # no copy
        return steps[0] if len(steps) == 1 else cs.chain_schema(steps)


def _union(choices: Sequence[cs.CoreSchema]) -> cs.CoreSchema:
    if len(choices) == 1:
        return choices[0]
    # the first branch that accepts wins; every branch is strict, so order is speed only
    union: list[cs.CoreSchema | tuple[cs.CoreSchema, str]] = list(choices)
    return cs.union_schema(union, mode="left_to_right")


def _count(value: Any) -> int | None:
    """A length bound; check_schema allows 2.0 for 2."""
    return None if value is None else int(value)


def _resolve_pointer(root: Any, pointer: str) -> Any:
    """Follow a JSON pointer the way the ``referencing`` library does."""
    node = root
    if not pointer:
        return node
    for segment in unquote(pointer[1:]).split("/"):
        if isinstance(node, list):
            if not segment.isdigit() or int(segment) >= len(node):
                raise _Unsupported("$ref points nowhere")
            node = node[int(segment)]
        elif isinstance(node, dict):
            key = segment.replace("~1", "/").replace("~0", "~")
            if key not in node:
                raise _Unsupported("$ref points nowhere")
            node = node[key]
        else:
            raise _Unsupported("$ref points nowhere")
    return node


def _number(schema: dict[str, Any], *, whole: bool) -> cs.CoreSchema:
    """Numbers: exact integer bounds in Rust, floats compared in Python as jsonschema does."""
    bounds = {kw: schema[kw] for kw in _BOUNDS if kw in schema}
    for bound in bounds.values():
        if isinstance(bound, float) and not math.isfinite(bound):
            raise _Unsupported("non-finite bound")
    # integer x: x >= 2.5 ⟺ x >= 3, x > 2.5 ⟺ x > 2, … (floor/ceil of a float are exact)
    ints = cs.int_schema(
        strict=True,
        ge=math.ceil(bounds["minimum"]) if "minimum" in bounds else None,
        le=math.floor(bounds["maximum"]) if "maximum" in bounds else None,
        gt=math.floor(bounds["exclusiveMinimum"]) if "exclusiveMinimum" in bounds else None,
        lt=math.ceil(bounds["exclusiveMaximum"]) if "exclusiveMaximum" in bounds else None,
    )
    if not whole and not bounds:
        return _union([ints, cs.is_instance_schema(float)])
    branches: list[cs.CoreSchema] = [ints]
    exact = all(isinstance(b, float) or abs(b) <= _MAX_EXACT_FLOAT_INT for b in bounds.values())
    if not whole and exact:
        # Rust compares floats too, but rejects NaN, which jsonschema lets through
        # every bound: the Python check below only runs when this one says no.
        branches.append(
            cs.chain_schema(
                [
                    cs.is_instance_schema(float),
                    cs.float_schema(
                        strict=True,
                        ge=_as_float(bounds.get("minimum")),
                        le=_as_float(bounds.get("maximum")),
                        gt=_as_float(bounds.get("exclusiveMinimum")),
                        lt=_as_float(bounds.get("exclusiveMaximum")),
                    ),
                ]
            )
        )
    branches.append(cs.no_info_plain_validator_function(_float_check(bounds, whole=whole)))
    return _union(branches)


def _as_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _float_check(bounds: dict[str, Any], *, whole: bool) -> Callable[[Any], Any]:
    """A float within the bounds, compared exactly as jsonschema's keywords compare."""
    minimum = bounds.get("minimum")
    maximum = bounds.get("maximum")
    above = bounds.get("exclusiveMinimum")
    below = bounds.get("exclusiveMaximum")

    def check(value: Any) -> Any:
        if (
            not isinstance(value, float)
            or (whole and not value.is_integer())
            or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)
            or (above is not None and value <= above)
            or (below is not None and value >= below)
        ):
            raise _reject()
        return value

    return check


def _kind_of(value: Any) -> str | None:
    """The JSON kind jsonschema sees in a Python value (None for bytes and the like)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return None


def _not_of_kinds(kinds: frozenset[str]) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if _kind_of(value) in kinds:
            raise _reject()
        return value

    return check


def _one_of_values(values: Sequence[Any]) -> cs.CoreSchema:
    """``enum`` and ``const``: equal as JSON values (1 == 1.0, True != 1)."""
    if not values:
        return _never()
    if all(isinstance(v, str) for v in values):
        return cs.literal_schema(list(values))  # str only: bytes and numbers never match

    def check(value: Any) -> Any:
        if not any(_json_equal(value, expected) for expected in values):
            raise _reject()
        return value

    return cs.no_info_plain_validator_function(check)


def _json_equal(one: Any, two: Any) -> bool:
    """jsonschema's equality (``jsonschema._utils.equal``), which the fast path must mirror."""
    if one is two:
        return True
    if isinstance(one, str) or isinstance(two, str):
        return bool(one == two)
    if isinstance(one, Sequence) and isinstance(two, Sequence):
        return len(one) == len(two) and all(
            _json_equal(a, b) for a, b in zip(one, two, strict=True)
        )
    if isinstance(one, Mapping) and isinstance(two, Mapping):
        return len(one) == len(two) and all(
            key in two and _json_equal(value, two[key]) for key, value in one.items()
        )
    return bool(_unbool(one) == _unbool(two))


_TRUE = object()
_FALSE = object()


def _unbool(value: Any) -> Any:
    if value is True:
        return _TRUE
    if value is False:
        return _FALSE
    return value


# ---------------------------------------------------------------------------------------
# Error messages: "items[2].n: must be >= 0, got -1"

_COMPARISONS = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}
_SIZES = {
    "minLength": ("at least", "characters"),
    "maxLength": ("at most", "characters"),
    "minItems": ("at least", "items"),
    "maxItems": ("at most", "items"),
    "minProperties": ("at least", "properties"),
    "maxProperties": ("at most", "properties"),
}


def _contract_error(error: ValidationError) -> ContractError:
    parts = list(error.absolute_path)
    rule = str(error.validator) if error.validator is not None else "false"
    value = error.instance
    expected: Any = error.validator_value
    if rule == "required" and isinstance(value, dict):
        missing = [name for name in expected if name not in value]
        named = [name for name in missing if repr(name) in error.message]
        parts.append((named or missing or ["?"])[0])
        reason = "required property missing"
    elif rule == "additionalProperties" and expected is False and isinstance(value, dict):
        schema = error.schema if isinstance(error.schema, dict) else {}
        listed = schema.get("properties", {})
        patterns = list(schema.get("patternProperties", {}))
        extras = [
            key
            for key in value
            if key not in listed and not any(re.search(p, key) for p in patterns)
        ]
        if extras:
            parts.append(extras[0])
        reason = "unexpected property (additionalProperties is false)"
    elif rule == "type" or (rule in ("anyOf", "oneOf") and _only_type_errors(error)):
        # an Optional field (anyOf: [{type: string}, {type: null}]) reads as one type error
        rule = "type"
        names = _type_names(error) if error.validator != "type" else _listed(expected)
        reason = f"expected {' or '.join(names)}, got {_show(value)}"
    elif rule in _COMPARISONS:
        reason = f"must be {_COMPARISONS[rule]} {_show(expected)}, got {_show(value)}"
    elif rule in _SIZES and isinstance(value, str | list | dict):
        bound, unit = _SIZES[rule]
        reason = f"must have {bound} {expected} {unit}, got {len(value)}"
    elif rule == "pattern":
        reason = f"must match pattern {json.dumps(expected)}, got {_show(value)}"
    elif rule == "enum":
        reason = f"must be one of {_show(expected, limit=_MESSAGE_MAX)}, got {_show(value)}"
    elif rule == "const":
        reason = f"must be {_show(expected)}, got {_show(value)}"
    elif rule == "false":
        reason = "not allowed here (the schema is false)"
    else:
        reason = _truncate(error.message, _MESSAGE_MAX)
    path = _path(parts)
    return ContractError(f"{path}: {reason}", path=path, rule=rule)


def _listed(types: Any) -> list[str]:
    return [types] if isinstance(types, str) else [str(t) for t in types]


def _only_type_errors(error: ValidationError) -> bool:
    return bool(error.context) and all(
        sub.validator == "type" and not sub.relative_path for sub in error.context
    )


def _type_names(error: ValidationError) -> list[str]:
    names: list[str] = []
    for sub in error.context:
        listed: Any = sub.validator_value
        names.extend(name for name in _listed(listed) if name not in names)
    return names


def _path(parts: Iterable[Any]) -> str:
    """``items[2].n``; keys that are not plain names are quoted: ``a["b c"]``."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _SIMPLE_KEY.fullmatch(part):
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(part, ensure_ascii=False)}]"
    return out or ROOT


def _show(value: Any, limit: int = _SHOW_MAX) -> str:
    """A value as it would read in JSON, shortened; payloads can be large or private."""
    if isinstance(value, bytes):
        return f"bytes (length {len(value)})"
    if isinstance(value, dict) and limit <= _SHOW_MAX:
        return "an object"
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return _truncate(text, limit)


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
