"""Registry records are decoded by every route cache and registrar on every change, most
of them heartbeats: a manifest already seen is reused, never trusted blindly."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from reach.errors import CodecError
from reach.messages import encode_model
from reach.models import Instance
from reach.registry.store import decode_instance
from tests.test_routing import instance


def test_a_heartbeat_reuses_the_manifest_and_changes_the_rest() -> None:
    first = decode_instance(encode_model(instance("reuse-1")))
    beat = instance("reuse-1").model_copy(update={"in_flight": 7, "last_heartbeat_at": 9.0})
    second = decode_instance(encode_model(beat))
    assert second == beat
    assert second.manifest is first.manifest  # validated once
    assert (second.in_flight, second.last_heartbeat_at) == (7, 9.0)


def test_a_new_manifest_is_validated_and_used() -> None:
    decode_instance(encode_model(instance("upgrade-1", version="1.0.0")))
    upgraded = decode_instance(encode_model(instance("upgrade-1", version="2.0.0")))
    assert upgraded.manifest.version == "2.0.0"


def _record(**changes: Any) -> bytes:
    raw = instance("broken-1").model_dump(mode="json")
    raw.update(changes)
    return bytes(msgpack.packb(raw, use_bin_type=True))


@pytest.mark.parametrize(
    ("data", "names"),
    [
        (b"\xc1", "not a valid msgpack"),
        (msgpack.packb([1, 2]), "not a valid Instance"),
        (_record(manifest={"agent_id": "broken-1"}), "manifest"),
        (_record(in_flight="many"), "not a valid Instance"),
        (_record(status="sleeping"), "not a valid Instance"),
    ],
)
def test_a_broken_record_is_a_codec_error_that_says_so(data: bytes, names: str) -> None:
    with pytest.raises(CodecError, match=names):
        decode_instance(data)


def test_a_manifest_that_failed_is_not_remembered_as_good() -> None:
    bad = instance("twice-1").model_dump(mode="json")
    bad["manifest"]["capabilities"] = [{"name": "Not A Token!"}]
    data = bytes(msgpack.packb(bad, use_bin_type=True))
    for _ in range(2):
        with pytest.raises(CodecError, match="manifest"):
            decode_instance(data)
    assert isinstance(decode_instance(encode_model(instance("twice-1"))), Instance)
