"""Pydantic's validation errors as the lines a person reads: ``path: problem``, one per
error, the path as it is written in the file (``capabilities[0].tags[2]``)."""

from __future__ import annotations

from pydantic import ValidationError

__all__ = ["format_validation_error"]

#: pydantic's errors of a value of the wrong type: the line says what was given
_TYPE_ERRORS = frozenset({"int_type", "float_type", "bool_type", "string_type"})
_KIND = {str: "the text", int: "the integer", float: "the number", bool: "the boolean"}


def format_validation_error(exc: ValidationError, *, root: str = "") -> list[str]:
    """Turn pydantic errors into ``capabilities[0].tags[2]: message`` lines."""
    lines = []
    for err in exc.errors(include_url=False):
        path = root
        for part in err["loc"]:
            if isinstance(part, int):
                path += f"[{part}]"
            else:
                path += f".{part}" if path else str(part)
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        elif err["type"] in _TYPE_ERRORS:
            value = err["input"]
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:39] + "…"
            msg = f"{msg}, got {_KIND.get(type(value), type(value).__name__)} {shown}"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        lines.append(f"{path or '<root>'}: {msg}")
    return lines
