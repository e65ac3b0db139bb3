"""Pydantic models to msgpack bytes and back, with typed errors.

The control messages (announce, heartbeat, probe, bye, token requests) travel as a
model's msgpack inside the envelope, and the KV records (registry, credentials, jobs)
are stored as one; the models themselves are in ``reach.wire.models`` and beside the code
that owns them. A message that does not decode is a CodecError, one that is not a
valid model a ContractError naming the field; a stored record that is not one is a
CodecError naming the record.
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

from pydantic import BaseModel, ValidationError

from reach.errors import CodecError, ContractError
from reach.wire import codec
from reach.wire.models import format_validation_error

__all__ = ["decode_model", "decode_record", "encode_model", "validate_record"]

M = TypeVar("M", bound=BaseModel)


def encode_model(model: BaseModel) -> bytes:
    return codec.encode(model.model_dump(mode="json", exclude_defaults=False), checked=False)


def decode_model(cls: type[M], data: bytes, limits: codec.Limits = codec.DEFAULT_LIMITS) -> M:
    """Decode and validate; CodecError for bad bytes, ContractError naming the field otherwise."""
    value = codec.decode(data, limits)
    try:
        # model_validate without its wrapper (every control message passes here)
        return cast(M, cls.__pydantic_validator__.validate_python(value))
    except ValidationError as exc:
        lines = format_validation_error(exc)
        path = lines[0].split(":", 1)[0] if lines else ""
        raise ContractError(
            f"invalid {cls.__name__}: " + "; ".join(lines), path=path, rule="schema"
        ) from None


def decode_record(cls: type[M], data: bytes, what: str) -> M:
    """Decode a stored record (KV value); CodecError if it is not a valid ``cls``."""
    return validate_record(cls, codec.decode(data), what)


def validate_record(cls: type[M], value: Any, what: str) -> M:
    """A stored record, already unpacked, as ``cls``; CodecError if it is not one."""
    try:
        return cls.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]["msg"]
        raise CodecError(f"{what} record is not a valid {cls.__name__}: {first}") from None
