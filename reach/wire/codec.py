"""msgpack with limits: the only way payloads become bytes and back.

Every limit breach and every malformed input becomes a CodecError that says what was
wrong; nothing else escapes from ``decode``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from reach.errors import CodecError

__all__ = [
    "DEFAULT_LIMITS",
    "Limits",
    "check_value",
    "decode",
    "encode",
    "packb",
    "plain_within",
]

#: ``msgpack.packb(value, use_bin_type=True)`` without a new Packer (and its buffer) per
#: call, which costs as much as the packing of a small message. Only for values this
#: library builds of exact built-in types (envelopes, audit rows): for those a pack runs
#: in C from start to end, so packs never interleave. Subclasses of dict, list, tuple or
#: int make msgpack call back into Python mid-pack, and a payload can be anything a user
#: passed, so payloads get a Packer of their own unless the walk finds them plain
#: (``encode``). The buffer grows to the largest message packed, which the size limits
#: bound (an envelope, an audit batch).
packb = msgpack.Packer(use_bin_type=True).pack
#: payloads of exact built-in types (what the fast walk vouches for: no callbacks into
#: Python mid-pack) share a Packer of their own; one that grew past ``_PLAIN_KEEP`` for a
#: large payload is replaced rather than kept that big
_plain_packer: Any = msgpack.Packer(use_bin_type=True)
_PLAIN_KEEP = 256 * 1024

_SCALARS = (str, int, float, bool, bytes, type(None))


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what the codec accepts; the defaults fit NATS' default 1 MiB max_payload."""

    max_bytes: int = 1024 * 1024
    max_depth: int = 32
    max_elements: int = 100_000


DEFAULT_LIMITS: Limits = Limits()


def check_value(value: Any, limits: Limits = DEFAULT_LIMITS) -> bool:
    """Walk a decoded (or to-be-encoded) value: depth, element count, key and value types.

    Returns whether the value is *plain* (what ``plain_within`` says): then
    ``encode(..., plain=True)`` packs it without a Packer of its own, and a contract
    check may take it as it is (``Validator.validate(..., plain=True)``)."""
    if limits.max_depth <= _FAST_DEPTH:  # the fast walk recurses: only for bounded depths
        elements = _elements(value, 1, limits.max_depth)
        if 0 <= elements <= limits.max_elements:
            return True
    _explain(value, limits)  # raises, naming the path and the rule (or finds it within)
    return False


def plain_within(value: Any, max_depth: int | None = None) -> bool:
    """Whether ``value`` is built of exact built-in types only (string keys, integers of
    at most 64 bits, finite floats) nested at most ``max_depth`` deep (at most, and by
    default, 64): what the fast walk vouches for, and what may be handed to code that
    recurses without a limit or reads floats as JSON numbers."""
    depth = _FAST_DEPTH if max_depth is None else min(max_depth, _FAST_DEPTH)
    return _elements(value, 1, depth) >= 0


#: the deepest nesting the fast walk follows (it recurses once per level)
_FAST_DEPTH = 64
_INT_MIN = -(2**63)
_INT_END = 2**64


def _elements(item: Any, depth: int, max_depth: int) -> int:
    """How many elements ``item`` holds, or -1 when it may break a rule (only exact
    built-in types are vouched for: the careful walk decides the rest). The fast path of
    ``check_value``: no paths built, no stack, for the payloads that are fine."""
    kind = type(item)
    if kind is dict:
        return _map_elements(item, depth, max_depth)
    if kind is list or kind is tuple:
        return _seq_elements(item, depth, max_depth)
    if kind is float:  # infinities and NaN: no JSON number, left to the careful checks
        return 0 if item - item == 0.0 else -1
    if kind is str or kind is bool or kind is bytes or item is None:
        return 0
    if kind is int:
        return 0 if _INT_MIN <= item < _INT_END else -1
    return -1


def _map_elements(item: dict[Any, Any], depth: int, max_depth: int) -> int:
    if depth > max_depth:
        return -1
    count = len(item)
    for key, sub in item.items():
        if type(key) is not str:
            return -1
        # the leaves here, as ``_elements`` would judge them: no call per leaf
        kind = type(sub)
        if kind is str or kind is bool or kind is bytes or sub is None:
            continue
        if kind is int:
            if _INT_MIN <= sub < _INT_END:
                continue
            return -1
        if kind is float:
            if sub - sub == 0.0:
                continue
            return -1
        if kind is dict:
            inner = _map_elements(sub, depth + 1, max_depth)
        elif kind is list or kind is tuple:
            inner = _seq_elements(sub, depth + 1, max_depth)
        else:
            return -1
        if inner < 0:
            return -1
        count += inner
    return count


def _seq_elements(item: list[Any] | tuple[Any, ...], depth: int, max_depth: int) -> int:
    if depth > max_depth:
        return -1
    count = len(item)
    for sub in item:
        # the leaves here, as in ``_map_elements``
        kind = type(sub)
        if kind is str or kind is bool or kind is bytes or sub is None:
            continue
        if kind is int:
            if _INT_MIN <= sub < _INT_END:
                continue
            return -1
        if kind is float:
            if sub - sub == 0.0:
                continue
            return -1
        if kind is dict:
            inner = _map_elements(sub, depth + 1, max_depth)
        elif kind is list or kind is tuple:
            inner = _seq_elements(sub, depth + 1, max_depth)
        else:
            return -1
        if inner < 0:
            return -1
        count += inner
    return count


def _explain(value: Any, limits: Limits) -> None:
    """The careful walk: raises the CodecError that names the path and the rule."""
    count = 0
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, dict):
            if depth > limits.max_depth:
                raise CodecError(
                    f"{path or '<root>'}: nested deeper than {limits.max_depth} levels",
                    path=path,
                    rule="max_depth",
                )
            count += len(item)
            for key, sub in item.items():
                if not isinstance(key, str):
                    raise CodecError(
                        f"{path or '<root>'}: map key {key!r} is a {type(key).__name__},"
                        " only string keys are allowed",
                        path=path,
                        rule="string_keys",
                    )
                if not isinstance(sub, _SCALARS):
                    stack.append((sub, depth + 1, f"{path}.{key}" if path else key))
                elif type(sub) is int and not -(2**63) <= sub < 2**64:
                    raise CodecError(f"{path}.{key}: integer out of range", rule="int_range")
        elif isinstance(item, list | tuple):
            if depth > limits.max_depth:
                raise CodecError(
                    f"{path or '<root>'}: nested deeper than {limits.max_depth} levels",
                    path=path,
                    rule="max_depth",
                )
            count += len(item)
            for i, sub in enumerate(item):
                if not isinstance(sub, _SCALARS):
                    stack.append((sub, depth + 1, f"{path}[{i}]"))
        elif not isinstance(item, _SCALARS):
            raise CodecError(
                f"{path or '<root>'}: values of type {type(item).__name__} cannot be sent",
                path=path,
                rule="type",
            )
        if count > limits.max_elements:
            raise CodecError(
                f"more than {limits.max_elements} elements in one message", rule="max_elements"
            )


def encode(
    value: Any, limits: Limits = DEFAULT_LIMITS, *, checked: bool = True, plain: bool = False
) -> bytes:
    """Pack a value; ``checked=False`` skips the walk for values the library built itself
    or walked already (``plain``: what ``check_value`` answered for it)."""
    if checked:
        plain = check_value(value, limits)
    try:
        if plain:  # the shared Packer of plain payloads (``_plain_packer``)
            data: bytes = _plain_packer.pack(value)  # an error mid-pack empties its buffer
            if len(data) > _PLAIN_KEEP:
                _renew_plain_packer()
        else:
            data = msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError(f"cannot encode value: {exc}", rule="type") from None
    if len(data) > limits.max_bytes:
        raise CodecError(
            f"payload is {len(data)} bytes, more than the limit of {limits.max_bytes}",
            rule="max_bytes",
        )
    return data


def _renew_plain_packer() -> None:
    """A new Packer for plain payloads: the old one's buffer grew for a large payload."""
    global _plain_packer
    _plain_packer = msgpack.Packer(use_bin_type=True)


def not_msgpack(what: str, exc: BaseException) -> CodecError:
    """The error for bytes msgpack could not unpack: it raises many types, some with an
    empty message (FormatError, for a reserved byte such as 0xc1), named by class then."""
    return CodecError(f"{what}: {str(exc) or type(exc).__name__}", rule="format")


def reject_ext(code: int, data: bytes) -> Any:
    """msgpack's ``ext_hook`` for bytes from the network: extension types are refused."""
    raise CodecError(f"msgpack extension type {code} is not allowed", rule="type")


def decode(data: bytes, limits: Limits = DEFAULT_LIMITS, *, checked: bool = True) -> Any:
    """Unpack bytes from the network; raises CodecError and nothing else."""
    if len(data) > limits.max_bytes:
        raise CodecError(
            f"payload is {len(data)} bytes, more than the limit of {limits.max_bytes}",
            rule="max_bytes",
        )
    if not data:
        raise CodecError("empty message: expected a msgpack value", rule="format")
    try:
        value = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            ext_hook=reject_ext,
            timestamp=0,
            max_array_len=limits.max_elements,
            max_map_len=limits.max_elements,
        )
    except CodecError:
        raise
    except msgpack.ExtraData:
        raise CodecError("trailing bytes after the msgpack value", rule="format") from None
    except UnicodeDecodeError:
        raise CodecError("a string is not valid UTF-8", rule="format") from None
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        raise not_msgpack("not a valid msgpack message", exc) from None
    if checked:
        check_value(value, limits)
    return value
