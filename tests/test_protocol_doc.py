"""docs/protocol.md stays true: its examples are messages the code reads, and its names
are the code's.

Every ``json`` example marked ``<!-- schema: NAME -->`` is valid against
``schemas/NAME.schema.json``; every example of an envelope (a map with ``"v"``) is one
``reach.wire.envelope`` reads, its ``<bin: …>`` bodies packed as msgpack, and a body marked
``<!-- body: NAME -->`` is valid against that schema.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgpack
import pytest
from jsonschema import Draft202012Validator

from reach.caller.remote import AUTHORIZATION_CODES
from reach.wire import envelope, subjects
from reach.wire.envelope import ERROR_KINDS

from .schema_helpers import load_schema

PROTOCOL = Path(__file__).parent.parent / "docs" / "protocol.md"
_BLOCK = re.compile(r"(?:<!-- (schema|body): ([a-z-]+) -->\n)?```json\n(.*?)\n```", re.S)
_BIN = re.compile(r"^<bin: (.*)>$", re.S)


def _examples() -> list[tuple[str, str, Any]]:
    text = PROTOCOL.read_text(encoding="utf-8")
    return [(mark, name, json.loads(body)) for mark, name, body in _BLOCK.findall(text)]


def _bodies(value: Any) -> tuple[Any, list[Any]]:
    """``value`` with every ``<bin: X>`` string as the msgpack bytes of X, and the Xs."""
    if isinstance(value, dict):
        found: list[Any] = []
        out = {}
        for key, item in value.items():
            out[key], inner = _bodies(item)
            found += inner
        return out, found
    if isinstance(value, str) and (match := _BIN.match(value)):
        body = json.loads(match.group(1))
        return msgpack.packb(body), [body]
    return value, []


def test_the_protocol_has_examples() -> None:
    examples = _examples()
    assert len(examples) >= 12
    assert sum(1 for _, _, value in examples if isinstance(value, dict) and "v" in value) >= 5


@pytest.mark.parametrize(("mark", "name", "value"), _examples())
def test_each_example_is_a_message_the_code_reads(mark: str, name: str, value: Any) -> None:
    if mark == "schema":
        errors = list(Draft202012Validator(load_schema(name)).iter_errors(value))
        assert errors == [], f"{name}: {errors[0].message}"
        return
    if not (isinstance(value, dict) and "v" in value):
        return  # a credentials file, JWT claims, a key record: described, not a message
    packed, bodies = _bodies(value)
    data = msgpack.packb(packed)
    if "ok" in value:
        reply = envelope.unpack_reply(data)
        assert reply.ok == value["ok"]
    else:
        meta, _ = envelope.unpack_request(data)
        assert meta.call_id == value["id"]
    if mark == "body":
        assert len(bodies) == 1
        errors = list(Draft202012Validator(load_schema(name)).iter_errors(bodies[0]))
        assert errors == [], f"{name}: {errors[0].message}"


def test_the_protocol_names_every_kind_code_and_name_of_the_code() -> None:
    text = PROTOCOL.read_text(encoding="utf-8")
    for kind in ERROR_KINDS:
        assert f"`{kind}`" in text
    for code in AUTHORIZATION_CODES:
        assert re.search(rf"`{code}(:[^`]*)?`", text), code
    for name in (
        subjects.TOKEN,
        subjects.REGISTRAR_PING,
        subjects.KEY_ROTATE,
        subjects.REGISTRAR_QUEUE,
        subjects.CALL_REPLIES,
        subjects.REGISTRY_BUCKET,
        subjects.KEYS_BUCKET,
        subjects.JOBS_BUCKET,
        subjects.AUDIT_STREAM,
        subjects.announce("<agent_id>"),
        subjects.heartbeat("<agent_id>"),
        subjects.bye("<agent_id>"),
        subjects.probe("<agent_id>"),
        subjects.capability("<capability>"),
        subjects.capability_instance("<capability>", "<agent_id>"),
    ):
        assert f"`{name}" in text, name
