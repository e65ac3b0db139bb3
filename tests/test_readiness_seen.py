"""A readiness without gauges (what most heartbeats and probe replies carry) is validated
once per (ready, reason) and given again; anything else is validated as ever."""

from __future__ import annotations

import math

import pytest

from reach.errors import ContractError
from reach.wire import codec, models
from reach.wire.modelcodec import decode_model, encode_model
from reach.wire.models import MAX_REASON, Heartbeat, Readiness


def _heartbeat(readiness: object) -> dict[str, object]:
    return {
        "agent_id": "ready-1",
        "instance_id": "ready-1-i",
        "seq": 1,
        "sent_at": 1.0,
        "in_flight": 0,
        "max_concurrency": 4,
        "readiness": readiness,
    }


@pytest.mark.parametrize(
    "value",
    [
        {"ready": True, "reason": "", "details": {}},
        {"ready": False, "reason": "pool exhausted", "details": {}},
        {"ready": False, "reason": "x" * (MAX_REASON + 40), "details": {}},
        {"ready": True, "reason": "", "details": {"queue": 3, "ratio": math.nan}},
        {"ready": True},
        {"ready": 1, "reason": "", "details": {}},
    ],
)
def test_the_answer_is_what_validation_gives(value: dict[str, object]) -> None:
    models._READINESS_SEEN.clear()
    fresh = Readiness.model_validate(value)
    again = Readiness.model_validate(dict(value))
    assert again == fresh
    assert again.model_dump() == fresh.model_dump()
    assert type(again.ready) is bool
    assert len(again.reason) <= MAX_REASON


def test_the_same_frozen_answer_is_given_for_the_same_plain_readiness() -> None:
    models._READINESS_SEEN.clear()
    first = Readiness.model_validate({"ready": False, "reason": "warming up", "details": {}})
    again = Readiness.model_validate({"ready": False, "reason": "warming up", "details": {}})
    other = Readiness.model_validate({"ready": False, "reason": "cold", "details": {}})
    assert again is first
    assert other is not first
    assert other.reason == "cold"
    with_gauges = Readiness.model_validate({"ready": False, "reason": "cold", "details": {"q": 1}})
    assert with_gauges.details == {"q": 1}


def test_the_answers_kept_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "_READINESS_SEEN_MAX", 3)
    models._READINESS_SEEN.clear()
    for n in range(10):
        Readiness.model_validate({"ready": True, "reason": f"r{n}", "details": {}})
        assert len(models._READINESS_SEEN) <= 3


@pytest.mark.parametrize(
    ("readiness", "field"),
    [
        ({"ready": "maybe", "reason": "", "details": {}}, "readiness.ready"),
        ({"ready": True, "reason": 5, "details": {}}, "readiness.reason"),
        ({"ready": True, "reason": "", "details": []}, "readiness.details"),
        ({"ready": True, "reason": "", "details": {}, "extra": 1}, "readiness.extra"),
    ],
)
def test_a_bad_readiness_in_a_heartbeat_is_refused_naming_the_field(
    readiness: dict[str, object], field: str
) -> None:
    body = encode_model(Heartbeat.model_validate(_heartbeat({})))
    value = codec.decode(body)
    value["readiness"] = readiness
    with pytest.raises(ContractError) as caught:
        decode_model(Heartbeat, codec.encode(value))
    assert caught.value.path == field
