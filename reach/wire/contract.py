"""Payload contracts: JSON Schema checks fast enough for the call hot path.

``compile_schema`` turns a capability's ``input_schema``/``output_schema`` into a
``Validator`` once. A payload is checked by jsonschema-rs (compiled Rust, Draft 2020-12,
every keyword) on every call; only when it says no does jsonschema (Python) look at the
payload, to word the error or to disagree::

    validator = compile_schema(capability.input_schema)   # once, cached by canonical JSON
    validator.validate(payload)   # ContractError("items[2].n: must be >= 0, got -1")

Where the two libraries differ, a payload either accepts is accepted:

* patterns follow ECMA-262 in jsonschema-rs, as JSON Schema specifies, and Python's
  ``re`` in jsonschema: ``\\s`` differs on a few control characters and U+FEFF, ``$``
  on a trailing newline;
* a tuple is an array to jsonschema-rs (it travels as one in msgpack), not to jsonschema;
* values JSON cannot hold (bytes, NaN, infinities) are left to jsonschema.

Schemas arrive over the network, so nothing here generates or executes Python code
from them, and remote ``$ref``s are never fetched (by either library).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import jsonschema_rs
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, ValidationError, best_match
from pydantic import BaseModel
from referencing import Registry
from referencing.exceptions import Unresolvable

from reach.errors import ConfigurationError, ContractError
from reach.wire import codec

__all__ = ["ROOT", "Validator", "compile_schema", "schema_from_model"]

#: how an error at the top of the payload names its field
ROOT = "<root>"

_CACHE_SIZE = 512
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
        """Whether jsonschema-rs checks payloads (else jsonschema alone: a schema it does
        not compile, such as one with a remote ``$ref``)."""
        return self._fast is not None

    def _fast_accepts(self, value: Any, plain: bool) -> bool:
        fast = self._fast
        if fast is None:
            return False
        # jsonschema-rs only sees plain values: it recurses without a limit (a value nested
        # 100,000 deep overflows the C stack), and it takes an infinity or NaN for a JSON
        # null, which passes "minimum" and the like
        if not plain and not codec.plain_within(value):
            return False
        try:
            return fast(value)
        except Exception:  # bytes, non-str keys, …: never a failure decided here
            return False

    def is_valid(self, value: Any, *, plain: bool = False) -> bool:
        """Whether ``value`` (as msgpack decodes it) matches the schema. ``plain``:
        ``codec.check_value`` said so for the value, with the default limits (no second
        walk)."""
        if self._fast is not None and self._fast_accepts(value, plain):
            return True
        try:
            return bool(self._slow.is_valid(value))
        except (Unresolvable, RecursionError, ArithmeticError, ValueError):
            return False

    def validate(self, value: Any, *, plain: bool = False) -> None:
        """Raise ``ContractError`` naming the field and the rule if ``value`` does not
        match. ``plain``: as for ``is_valid``."""
        fast = self._fast
        if fast is not None and plain:  # ``_fast_accepts``, inline: it runs on every call
            try:
                if fast(value):
                    return
            except Exception:  # never a failure decided here
                pass
        elif self._fast_accepts(value, plain):
            return
        try:
            error = best_match(self._slow.iter_errors(value))
        except Unresolvable as exc:
            raise ContractError(
                f"{ROOT}: the schema has a $ref that cannot be resolved: {exc}",
                path=ROOT,
                rule="$ref",
            ) from None
        except RecursionError:
            raise ContractError(
                f"{ROOT}: nested too deeply to check against the schema", path=ROOT, rule="depth"
            ) from None
        except (ArithmeticError, ValueError) as exc:
            # a keyword that cannot judge the value: "multipleOf" of NaN or an infinity
            raise ContractError(
                f"{ROOT}: a value the schema cannot judge ({exc}); NaN and infinities are"
                " not JSON numbers",
                path=ROOT,
                rule="value",
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
# The fast path: jsonschema-rs


def _no_remote(uri: str) -> Any:
    """jsonschema-rs's retriever: schemas come from the network, so nothing is fetched."""
    raise ValueError(f"remote $ref {uri} is never fetched")


def _fast_check(schema: dict[str, Any] | bool) -> Callable[[Any], bool] | None:
    if schema is True or schema == {}:
        return _accept
    try:
        return jsonschema_rs.Draft202012Validator(schema, retriever=_no_remote).is_valid
    except Exception:  # a $ref it cannot resolve, a pattern its regex engine refuses, …
        return None


def _accept(value: Any) -> bool:
    return True


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
