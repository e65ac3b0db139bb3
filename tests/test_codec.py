"""The codec and the envelope: round trips, limits, and nothing but CodecError on bad bytes."""

from __future__ import annotations

import contextlib
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reach.errors import CodecError, ContractError
from reach.wire import codec, envelope
from reach.wire.codec import Limits
from reach.wire.envelope import RequestMeta

FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth - 1):
        value = [value]
    return value


# -- codec: round trips ----------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        -1,
        2**64 - 1,
        -(2**63),
        1.5,
        "",
        "héllo ✓",
        b"\x00\xff",
        [],
        {},
        [1, "two", 3.0, None, b"five"],
        {"industry": "ev", "time_range": "2025Q3", "include_charts": True},
        {"a": {"b": {"c": [1, {"d": None}]}}},
    ],
)
def test_values_round_trip(value: Any) -> None:
    assert codec.decode(codec.encode(value)) == value


def test_tuples_encode_as_lists() -> None:
    assert codec.decode(codec.encode({"t": (1, 2)})) == {"t": [1, 2]}


def test_bytes_and_str_stay_distinct() -> None:
    decoded = codec.decode(codec.encode({"s": "abc", "b": b"abc"}))
    assert type(decoded["s"]) is str
    assert type(decoded["b"]) is bytes


class _Mapping(dict[str, Any]):
    pass


def test_plain_values_are_said_to_be_plain_and_others_not() -> None:
    assert codec.check_value({"a": [1, 2.0, "x", None, b"y", (True,)]}) is True
    assert codec.check_value(_Mapping(a=1)) is False  # a subclass: the careful walk's
    assert codec.check_value({"a": _Mapping(b=1)}) is False


@pytest.mark.parametrize(
    "value",
    [{"industry": "ev", "segments": ["a", "b"], "n": 2**64 - 1}, _Mapping(a=[1, 2]), [(1, "x")]],
)
def test_plain_and_other_values_encode_as_msgpack_does(value: Any) -> None:
    expected = msgpack.packb(value, use_bin_type=True)
    assert codec.encode(value) == expected
    plain = codec.check_value(value)
    assert codec.encode(value, checked=False, plain=plain) == expected


def test_an_error_midway_through_a_plain_value_leaves_nothing_behind() -> None:
    with pytest.raises(CodecError):
        codec.encode({"a": "fine", "b": "\ud800"})  # a lone surrogate is not UTF-8
    assert codec.encode({"c": 1}) == msgpack.packb({"c": 1})


def test_a_large_plain_value_does_not_keep_the_shared_packer_large() -> None:
    before = codec._plain_packer
    big = {"blob": "x" * (codec._PLAIN_KEEP + 1)}
    assert codec.decode(codec.encode(big)) == big
    assert codec._plain_packer is not before  # replaced, with its large buffer
    kept = codec._plain_packer
    assert codec.encode({"small": 1}) == msgpack.packb({"small": 1})
    assert codec._plain_packer is kept


# -- codec: limits ---------------------------------------------------------------------


def test_encoding_more_than_max_bytes_is_refused() -> None:
    with pytest.raises(CodecError, match="more than the limit of 100") as info:
        codec.encode("x" * 200, Limits(max_bytes=100))
    assert info.value.rule == "max_bytes"


def test_decoding_more_than_max_bytes_is_refused_before_unpacking() -> None:
    data = msgpack.packb("x" * 200)
    with pytest.raises(CodecError, match="more than the limit") as info:
        codec.decode(data, Limits(max_bytes=100))
    assert info.value.rule == "max_bytes"


def test_exactly_max_bytes_is_allowed() -> None:
    data = codec.encode("x" * 10)
    assert codec.decode(data, Limits(max_bytes=len(data))) == "x" * 10


def test_depth_at_the_limit_is_allowed() -> None:
    value = nested(4)
    assert codec.decode(codec.encode(value, Limits(max_depth=4)), Limits(max_depth=4)) == value


@pytest.mark.parametrize("deep", [nested(5), {"a": {"b": {"c": {"d": {"e": 1}}}}}])
def test_encoding_deeper_than_max_depth_is_refused(deep: Any) -> None:
    with pytest.raises(CodecError, match="nested deeper than 3 levels") as info:
        codec.encode(deep, Limits(max_depth=3))
    assert info.value.rule == "max_depth"


def test_decoding_deeper_than_max_depth_is_refused() -> None:
    data = msgpack.packb(nested(50))
    with pytest.raises(CodecError, match="nested deeper than 32 levels"):
        codec.decode(data)


def test_very_deep_nesting_is_a_codec_error_not_a_crash() -> None:
    data = b"\x91" * 100_000 + b"\xc0"  # 100 000 nested one-element arrays
    with pytest.raises(CodecError):
        codec.decode(data)


def test_depth_errors_name_the_path() -> None:
    with pytest.raises(CodecError) as info:
        codec.encode({"outer": {"inner": [[1]]}}, Limits(max_depth=2))
    assert info.value.path.startswith("outer")


def test_too_many_elements_are_refused_when_encoding() -> None:
    with pytest.raises(CodecError, match="more than 10 elements") as info:
        codec.encode(list(range(11)), Limits(max_elements=10))
    assert info.value.rule == "max_elements"


def test_elements_are_counted_across_the_whole_value() -> None:
    value = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]  # 3 + 9 = 12 elements, no list longer than 3
    with pytest.raises(CodecError, match="more than 10 elements"):
        codec.encode(value, Limits(max_elements=10))
    with pytest.raises(CodecError, match="more than 10 elements"):
        codec.decode(msgpack.packb(value), Limits(max_elements=10))


def test_one_huge_array_is_refused_when_decoding() -> None:
    data = msgpack.packb(list(range(20)))
    with pytest.raises(CodecError):
        codec.decode(data, Limits(max_elements=10))


def test_an_array_header_claiming_billions_of_elements_is_refused() -> None:
    data = b"\xdd\xff\xff\xff\xff"  # array32 with 4 294 967 295 elements, no content
    with pytest.raises(CodecError):
        codec.decode(data)


# -- codec: keys, types, garbage -------------------------------------------------------


def test_int_map_keys_are_refused_when_encoding() -> None:
    with pytest.raises(CodecError, match="map key 1 is a int, only string keys") as info:
        codec.encode({"ok": {1: "one"}})
    assert info.value.rule == "string_keys"
    assert info.value.path == "ok"


def test_bytes_map_keys_are_refused_when_encoding() -> None:
    with pytest.raises(CodecError, match="map key b'k' is a bytes, only string keys"):
        codec.encode({b"k": 1})


def test_int_map_keys_are_refused_when_decoding() -> None:
    with pytest.raises(CodecError, match="map key"):
        codec.decode(msgpack.packb({1: "one"}))


def test_bytes_map_keys_are_refused_when_decoding() -> None:
    data = msgpack.packb({b"k": 1}, use_bin_type=True)
    with pytest.raises(CodecError, match="map key b'k' is a bytes, only string keys"):
        codec.decode(data)


def test_nested_non_string_keys_are_refused_when_decoding() -> None:
    data = msgpack.packb({"outer": [{"fine": 1}, {b"bad": 2}]}, use_bin_type=True)
    with pytest.raises(CodecError, match="only string keys") as info:
        codec.decode(data)
    assert info.value.path == "outer[1]"


@pytest.mark.parametrize("value", [object(), {1, 2}, {"z": complex(1, 2)}, bytearray()])
def test_values_of_other_types_cannot_be_sent(value: Any) -> None:
    with pytest.raises(CodecError, match="cannot be sent"):
        codec.encode(value)


@pytest.mark.parametrize("number", [2**64, -(2**63) - 1])
def test_integers_outside_64_bits_cannot_be_sent(number: int) -> None:
    with pytest.raises(CodecError):
        codec.encode({"n": number})
    with pytest.raises(CodecError):
        codec.encode([number])


def test_ext_types_are_refused() -> None:
    data = msgpack.packb(msgpack.ExtType(5, b"payload"))
    with pytest.raises(CodecError, match="extension type 5 is not allowed"):
        codec.decode(data)


def test_nested_ext_types_are_refused() -> None:
    data = msgpack.packb({"x": [msgpack.ExtType(42, b"")]})
    with pytest.raises(CodecError, match="extension type 42"):
        codec.decode(data)


def test_msgpack_timestamps_are_refused() -> None:
    data = msgpack.packb({"at": msgpack.Timestamp(1_700_000_000, 0)})
    with pytest.raises(CodecError, match="Timestamp"):
        codec.decode(data)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # reserved, never valid
        b"\x92\x01",  # array of 2 with one element
        b"\xd9",  # str8 without its length
        b"\xa3ab",  # str of 3 with 2 bytes
        b"\xa2\xff\xfe",  # not UTF-8
        b"\xde\x00\x01\xa1k",  # map of 1 without its value
    ],
)
def test_garbage_bytes_are_codec_errors(data: bytes) -> None:
    with pytest.raises(CodecError) as info:
        codec.decode(data)
    assert str(info.value).strip()


def test_reserved_byte_error_says_what_was_wrong() -> None:
    with pytest.raises(CodecError, match=r"not a valid msgpack message: \w+"):
        codec.decode(b"\xc1")


def test_trailing_bytes_are_refused() -> None:
    with pytest.raises(CodecError, match="trailing bytes"):
        codec.decode(msgpack.packb({"a": 1}) + b"\x00")


def test_codec_error_is_a_contract_error() -> None:
    with pytest.raises(ContractError):
        codec.decode(b"\xc1")


def test_check_value_alone_checks_without_encoding() -> None:
    codec.check_value({"a": [1, 2]})
    with pytest.raises(CodecError):
        codec.check_value({"a": {1: 2}})


# -- codec: properties -----------------------------------------------------------------

json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=8), children, max_size=6)
    ),
    max_leaves=40,
)


@FUZZ
@given(st.binary(max_size=256))
def test_any_bytes_decode_or_raise_codec_error(data: bytes) -> None:
    with contextlib.suppress(CodecError):
        codec.decode(data)


@FUZZ
@given(json_like)
def test_json_like_values_round_trip_or_raise_codec_error(value: Any) -> None:
    try:
        data = codec.encode(value, Limits(max_depth=4, max_elements=60))
    except CodecError:
        return
    assert codec.decode(data, Limits(max_depth=4, max_elements=60)) == value


@FUZZ
@given(st.recursive(st.integers() | st.text(max_size=4), lambda c: st.lists(c, max_size=3)))
def test_values_with_wild_integers_round_trip_or_raise_codec_error(value: Any) -> None:
    try:
        data = codec.encode(value)
    except CodecError:
        return
    assert codec.decode(data) == value


class _Dict(dict[Any, Any]):
    pass


#: values the fast walk must not vouch for on its own: other key types, subclasses,
#: huge integers, values msgpack cannot carry, all at any depth
any_value = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=4)
    | st.binary(max_size=4)
    | st.sampled_from([object(), {1, 2}, 1j]),
    lambda children: (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=3).map(tuple)
        | st.dictionaries(
            st.text(max_size=3) | st.integers() | st.binary(max_size=2), children, max_size=4
        )
        | st.dictionaries(st.text(max_size=3), children, max_size=3).map(_Dict)
    ),
    max_leaves=30,
)


def _verdict(check: Any, value: Any, limits: Limits) -> str | None:
    try:
        check(value, limits)
    except CodecError as exc:
        return str(exc)
    return None


@FUZZ
@given(any_value, st.integers(min_value=1, max_value=5), st.integers(min_value=0, max_value=40))
def test_the_fast_walk_agrees_with_the_careful_walk(value: Any, depth: int, elements: int) -> None:
    # check_value vouches for a value without building paths; whenever it would not, the
    # careful walk decides and explains: so the two must reach the same verdict, with the
    # same message, for any value and limits
    limits = Limits(max_depth=depth, max_elements=elements)
    assert _verdict(codec.check_value, value, limits) == _verdict(codec._explain, value, limits)


def test_limits_deeper_than_the_fast_walk_follows_are_checked_by_the_careful_walk() -> None:
    deep = Limits(max_depth=10_000)
    codec.check_value(nested(5_000), deep)
    with pytest.raises(CodecError, match="nested deeper than 10000"):
        codec.check_value(nested(10_002), deep)


# -- envelope --------------------------------------------------------------------------


def test_a_minimal_request_round_trips() -> None:
    meta, body = envelope.unpack_request(envelope.pack_request(RequestMeta("call-1"), b"body"))
    assert meta == RequestMeta(call_id="call-1")
    assert body == b"body"


def test_a_full_request_round_trips() -> None:
    sent = RequestMeta(
        call_id="call-2",
        token="tok",
        deadline_ms=1_760_000_000_000,
        idempotency_key="idem",
        attempt=3,
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        tracestate="vendor=1",
        caller="agent-a",
    )
    received, body = envelope.unpack_request(envelope.pack_request(sent, codec.encode([1])))
    assert received == sent
    assert codec.decode(body) == [1]


def test_ok_and_error_replies_round_trip() -> None:
    ok = envelope.unpack_reply(envelope.pack_ok(b"\x01", by="inst-1"))
    assert ok == envelope.Reply(ok=True, body=b"\x01", by="inst-1")
    err = envelope.unpack_reply(envelope.pack_error("business", "no_data", "nothing", by="i"))
    assert err == envelope.Reply(
        ok=False, kind="business", code="no_data", description="nothing", by="i"
    )


def test_long_error_descriptions_are_cut_to_the_metadata_limit() -> None:
    reply = envelope.unpack_reply(envelope.pack_error("internal", "boom", "x" * 10_000))
    assert len(reply.description) == 4096


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"v": 2, "id": "c"}, "unsupported protocol version 2"),
        ({"id": "c"}, "unsupported protocol version None"),
        ({"v": 1}, "'id'"),
        ({"v": 1, "id": ""}, "'id'"),
        ({"v": 1, "id": "c" * 129}, "'id'"),
        ({"v": 1, "id": 7}, "'id'"),
        ({"v": 1, "id": "c", "b": "text"}, "'b'"),
        ({"v": 1, "id": "c", "tok": 5}, "'tok'"),
        ({"v": 1, "id": "c", "tok": "t" * 5000}, "'tok'"),
        ({"v": 1, "id": "c", "dl": 1.5}, "'dl'"),
        ({"v": 1, "id": "c", "dl": True}, "'dl'"),
        ({"v": 1, "id": "c", "at": 0}, "'at'"),
        ({"v": 1, "id": "c", "at": 101}, "'at'"),
        ({"v": 1, "id": "c", "at": None}, "'at'"),
        ({"v": 1, "id": "c", "from": ["x"]}, "'from'"),
    ],
)
def test_malformed_requests_are_codec_errors(env: dict[str, Any], match: str) -> None:
    with pytest.raises(CodecError, match=match):
        envelope.unpack_request(msgpack.packb(env, use_bin_type=True))


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"v": 1, "ok": True, "b": "text"}, "'b'"),
        ({"v": 1, "ok": False}, "'err'"),
        ({"v": 1, "ok": False, "err": "boom"}, "'err'"),
        ({"v": 1, "ok": False, "err": {"kind": "weird"}}, "unknown error kind 'weird'"),
        ({"v": 1, "ok": False, "err": {"kind": ["list"]}}, "unknown error kind"),
        ({"v": 1, "ok": False, "err": {"kind": {"map": 1}}}, "unknown error kind"),
        ({"v": 3, "ok": True}, "unsupported protocol version 3"),
    ],
)
def test_malformed_replies_are_codec_errors(env: dict[str, Any], match: str) -> None:
    with pytest.raises(CodecError, match=match):
        envelope.unpack_reply(msgpack.packb(env, use_bin_type=True))


@pytest.mark.parametrize("unpack", [envelope.unpack_request, envelope.unpack_reply])
@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        msgpack.packb([1, "id"]),
        msgpack.packb("just a string"),
        msgpack.packb({1: "int key"}),
        msgpack.packb(msgpack.ExtType(1, b"")),
        msgpack.packb({"v": 1, "id": "c", "ok": True}) + b"\x00",
    ],
)
def test_envelope_garbage_is_a_codec_error(unpack: Any, data: bytes) -> None:
    with pytest.raises(CodecError):
        unpack(data)


@pytest.mark.parametrize("unpack", [envelope.unpack_request, envelope.unpack_reply])
def test_oversized_envelopes_are_refused(unpack: Any) -> None:
    with pytest.raises(CodecError, match="more than the limit of 10"):
        unpack(envelope.pack_ok(b"x" * 100), 10)


def test_unknown_envelope_keys_are_ignored() -> None:
    data = msgpack.packb({"v": 1, "id": "c", "b": b"", "future": {"x": 1}}, use_bin_type=True)
    meta, _ = envelope.unpack_request(data)
    assert meta.call_id == "c"


def test_the_body_is_not_decoded_by_the_envelope() -> None:
    # Metadata is checked before the body is decoded, so even garbage bodies pass through.
    _, body = envelope.unpack_request(envelope.pack_request(RequestMeta("c"), b"\xc1\xc1"))
    assert body == b"\xc1\xc1"


@FUZZ
@given(st.binary(max_size=256))
def test_any_bytes_unpack_as_request_or_raise_codec_error(data: bytes) -> None:
    with contextlib.suppress(CodecError):
        envelope.unpack_request(data)


@FUZZ
@given(st.binary(max_size=256))
def test_any_bytes_unpack_as_reply_or_raise_codec_error(data: bytes) -> None:
    with contextlib.suppress(CodecError):
        envelope.unpack_reply(data)


int64 = st.integers(min_value=-(2**63), max_value=2**64 - 1)
envelope_like = st.dictionaries(
    st.sampled_from(["v", "id", "b", "tok", "dl", "ik", "at", "tp", "ts", "from", "ok", "err"]),
    st.one_of(
        st.just(1),
        int64,
        st.booleans(),
        st.none(),
        st.text(max_size=5),
        st.binary(max_size=5),
        st.lists(int64, max_size=2),
        st.dictionaries(
            st.sampled_from(["kind", "code", "desc"]),
            st.one_of(
                st.sampled_from(sorted(envelope.ERROR_KINDS)),
                st.text(max_size=3),
                st.none(),
                st.lists(int64, max_size=2),
            ),
        ),
    ),
)


@FUZZ
@given(envelope_like)
def test_envelope_shaped_maps_unpack_or_raise_codec_error(env: dict[str, Any]) -> None:
    data = msgpack.packb(env, use_bin_type=True)
    for unpack in (envelope.unpack_request, envelope.unpack_reply):
        with contextlib.suppress(CodecError):
            unpack(data)


def test_the_shared_packer_is_clean_after_a_failure_and_across_threads() -> None:
    """codec.packb reuses one msgpack Packer for envelopes: a failed pack must leave
    nothing behind, and packs from several threads (sync handlers run in worker threads)
    never mix."""
    import threading

    from reach.wire.codec import packb

    with pytest.raises(TypeError):
        packb({"ok": 1, "bad": object()})
    assert msgpack.unpackb(packb({"after": [1, 2]})) == {"after": [1, 2]}
    values = [{"v": 1, "id": f"c-{n}", "b": b"x" * (n % 300), "dl": n} for n in range(2000)]
    failures: list[int] = []

    def pack_all() -> None:
        for n, value in enumerate(values):
            if msgpack.unpackb(packb(value)) != value:
                failures.append(n)

    threads = [threading.Thread(target=pack_all) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_a_payload_whose_packing_calls_back_into_python_is_packed_whole() -> None:
    """A dict subclass makes msgpack call its items() mid-pack; a payload doing so (and
    packing something else meanwhile) must still come out whole: payloads do not share
    the envelopes' packer."""

    class Chatty(dict[str, Any]):
        def items(self) -> Any:
            envelope.pack_ok(b"meanwhile", by="x")
            return super().items()

    data = codec.encode(Chatty(a=1, b=[1, 2]), checked=False)
    assert msgpack.unpackb(data) == {"a": 1, "b": [1, 2]}
