"""A capability's JSON Schema checked before a manifest or a registry record takes it:
nested no deeper than a contract needs, JSON (no NaN, no infinity), valid against the
Draft 2020-12 meta-schema; each distinct schema checked once per process.

jsonschema is imported by the first check: a process that reads manifests or records
without schemas (``reach validate`` of a manifest without one, ``reach alerts``) does not
load it."""

from __future__ import annotations

import json
from typing import Any

from pydantic_core import PydanticCustomError

__all__ = ["MAX_SCHEMA_DEPTH", "checked_json_schema"]

#: schemas already checked, by canonical JSON: every registry record carries its
#: capabilities' schemas, and checking one against the meta-schema costs more than the
#: rest of decoding the record — per record decoded, by every route cache, on every
#: heartbeat, without this memo
_CHECKED_SCHEMAS: dict[str, None] = {}
_CHECKED_MAX = 4096


#: nesting of a capability's JSON Schema at most (objects and arrays): far more than any
#: contract needs, and well below where checking it would exhaust Python's stack
MAX_SCHEMA_DEPTH = 64


def _depth_over(value: Any, limit: int) -> bool:
    """Whether ``value`` nests objects/arrays more than ``limit`` deep (no recursion)."""
    level: list[Any] = [value]
    for _ in range(limit + 1):
        below: list[Any] = []
        for item in level:
            if isinstance(item, dict):
                below.extend(item.values())
            elif isinstance(item, list | tuple):
                below.extend(item)
        if not below:
            return False
        level = below
    return True


def _remote_ref(value: Any) -> str | None:
    """The first ``$ref`` of ``value`` that names another document than the schema (one
    not within it: neither a ``#`` fragment nor a URI one of its ``$id`` gives)."""
    refs: list[str] = []
    ids: set[str] = set()
    pending: list[Any] = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            ref, own = item.get("$ref"), item.get("$id")
            if isinstance(ref, str):
                refs.append(ref)
            if isinstance(own, str):
                ids.add(own.split("#", 1)[0])
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    for ref in refs:
        document = ref.split("#", 1)[0]
        if document and document not in ids:
            return ref
    return None


def checked_json_schema(value: dict[str, Any]) -> dict[str, Any]:
    """``value`` if it is a JSON Schema a contract may carry (Draft 2020-12, JSON only, at
    most ``MAX_SCHEMA_DEPTH`` deep); a PydanticCustomError saying what is wrong otherwise."""
    if _depth_over(value, MAX_SCHEMA_DEPTH):
        raise PydanticCustomError(
            "json_schema",
            "not a valid JSON Schema: nested more than {limit} levels deep",
            {"limit": MAX_SCHEMA_DEPTH},
        )
    try:
        key = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except ValueError:
        # NaN or an infinity: JSON cannot say them, and a schema that holds one means
        # something else to every reader (msgpack keeps it, JSON turns it into null)
        raise PydanticCustomError(
            "json_schema", "not a valid JSON Schema: it holds NaN or an infinity", {}
        ) from None
    except TypeError:
        key = None  # not JSON: the check below says what is wrong
    if key is not None and key in _CHECKED_SCHEMAS:
        return value
    remote = _remote_ref(value)
    if remote is not None:
        raise PydanticCustomError(
            "json_schema",
            "not a valid contract: $ref {ref} names another document, which is never"
            " fetched (put that schema under $defs and refer to it as #/$defs/...)",
            {"ref": repr(remote)},
        )
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(value)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        at = f" at {where}" if where else ""
        raise PydanticCustomError(
            "json_schema", "not a valid JSON Schema{at}: {msg}", {"at": at, "msg": exc.message}
        ) from None
    if key is not None:
        if len(_CHECKED_SCHEMAS) >= _CHECKED_MAX:
            _CHECKED_SCHEMAS.clear()
        _CHECKED_SCHEMAS[key] = None
    return value
