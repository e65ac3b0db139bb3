"""The protocol reader (``reach.transport.protocol``): what it hands to subscriptions is what
nats-py's own parser hands them, message for message and in order, however the bytes
are split across reads; and a connection using it keeps its messages flowing on a real
server (inline and queued subscriptions side by side, headers, payloads over a read)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import nats
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.protocol.parser import Parser

from reach.testing import NatsServer
from reach.transport import Message, connect
from reach.transport.natsio import InlineDelivery, subscribe_inline
from reach.transport.protocol import ProtocolReader

#: subscriptions of the parsing client: inline, queued, inline that ends after two
#: messages (nats-py's ``max_msgs``); 9 is no subscription
INLINE, QUEUED, LIMITED, NOBODY = 1, 2, 3, 9


@dataclass(frozen=True)
class Op:
    kind: str  # "msg", "hmsg", "pong", "ok"
    sid: int = INLINE
    subject: str = "a.b"
    reply: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    payload: bytes = b""

    def wire(self) -> bytes:
        if self.kind == "pong":
            return b"PONG\r\n"
        if self.kind == "ok":
            return b"+OK\r\n"
        reply = f" {self.reply}" if self.reply else ""
        if self.kind == "msg":
            head = f"MSG {self.subject} {self.sid}{reply} {len(self.payload)}\r\n"
            return head.encode() + self.payload + b"\r\n"
        block = b"NATS/1.0\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in self.headers)
        block += b"\r\n"
        total = len(block) + len(self.payload)
        head = f"HMSG {self.subject} {self.sid}{reply} {len(block)} {total}\r\n"
        return head.encode() + block + self.payload + b"\r\n"


class _Client:
    """An unconnected nats-py client with the three subscriptions, recording what each
    is handed."""

    def __init__(self, parser: type[Any]) -> None:
        self.nc = NatsClient()
        self.seen: list[tuple[int, str, str, bytes, dict[str, str] | None]] = []
        self.queued: Subscription | None = None
        for sid in (INLINE, QUEUED, LIMITED):
            sub = Subscription(self.nc, sid, f"s{sid}", pending_msgs_limit=10_000)
            if sid == QUEUED:
                self.queued = sub
            else:
                sub._pending_queue = InlineDelivery(sub, self._recorder(sid))  # type: ignore[assignment]
            if sid == LIMITED:
                sub._max_msgs = 2
            self.nc._subs[sid] = sub
        self.nc._pongs = [asyncio.get_running_loop().create_future() for _ in range(64)]
        self.parser = parser(self.nc)

    def _recorder(self, sid: int) -> Any:
        def record(msg: Msg) -> None:
            self.seen.append((sid, msg.subject, msg.reply, msg.data, msg.headers))

        return record

    async def feed(self, data: bytes, cuts: list[int]) -> None:
        last = 0
        for cut in [*sorted(set(cuts)), len(data)]:
            await self.parser.parse(data[last:cut])
            last = cut

    def outcome(self) -> tuple[Any, ...]:
        """What the subscriptions were handed (the queued one's queue is emptied)."""
        assert self.queued is not None
        queue = self.queued._pending_queue
        queued = []
        while not queue.empty():
            msg = queue.get_nowait()
            queued.append((msg.subject, msg.reply, msg.data, msg.headers))
        pongs = sum(f.done() for f in self.nc._pongs)
        return (
            self.seen,
            queued,
            dict(self.nc.stats),
            self.nc._pongs_received,
            pongs,
            sorted(self.nc._subs),
            self.queued._pending_size,
        )


_tokens = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=12)
_payloads = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"MSG a 1 2\r\nxx\r\n", b"\r\n", b"PING\r\n", b"HMSG ", b""]),
)
_ops = st.one_of(
    st.builds(
        Op,
        kind=st.just("msg"),
        sid=st.sampled_from([INLINE, INLINE, QUEUED, LIMITED, NOBODY]),
        subject=st.builds(lambda a, b: f"{a}.{b}", _tokens, _tokens),
        reply=st.one_of(st.just(""), st.builds(lambda t: f"_INBOX.{t}", _tokens)),
        payload=_payloads,
    ),
    st.builds(
        Op,
        kind=st.just("hmsg"),
        sid=st.sampled_from([INLINE, QUEUED, NOBODY]),
        subject=_tokens,
        reply=st.one_of(st.just(""), _tokens),
        headers=st.lists(st.tuples(_tokens, _tokens), min_size=1, max_size=2).map(tuple),
        payload=_payloads,
    ),
    st.builds(Op, kind=st.sampled_from(["pong", "ok"])),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_ops, min_size=1, max_size=20), data=st.data())
async def test_the_reader_hands_over_what_nats_py_s_parser_does(
    ops: list[Op], data: st.DataObject
) -> None:
    stream = b"".join(op.wire() for op in ops)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=8), label="cuts")
    theirs, ours = _Client(Parser), _Client(ProtocolReader)
    await theirs.feed(stream, cuts)
    await ours.feed(stream, cuts)
    assert ours.outcome() == theirs.outcome()
    assert ours.parser._inner.buf == theirs.parser.buf  # nothing held back but a split op


async def test_every_split_of_a_stream_gives_the_same_messages() -> None:
    ops = [
        Op("msg", INLINE, "x.y", "_INBOX.r", payload=b"one\r\ntwo"),
        Op("hmsg", INLINE, "h", "", (("k", "v"),), b"with headers"),
        Op("msg", QUEUED, "q", payload=b"queued"),
        Op("pong"),
        Op("msg", NOBODY, "n", payload=b"nobody"),
        Op("msg", INLINE, "x.z", payload=b""),
    ]
    stream = b"".join(op.wire() for op in ops)
    reference = _Client(Parser)
    await reference.feed(stream, [])
    expected = reference.outcome()
    for cut in range(len(stream) + 1):
        for second in (cut, min(len(stream), cut + 7)):
            ours = _Client(ProtocolReader)
            await ours.feed(stream, [cut, second])
            assert ours.outcome() == expected, (cut, second)


async def test_a_connection_reads_inline_queued_and_header_messages_in_order(
    nats_server: NatsServer,
) -> None:
    conn = await connect([nats_server.url], name="test-reader")
    publisher = await nats.connect(nats_server.url)
    try:
        assert isinstance(conn._nc._ps, ProtocolReader)
        inline: list[tuple[bytes, dict[str, str] | None]] = []
        queued: list[bytes] = []
        done = asyncio.Event()

        def on_inline(msg: Msg) -> None:
            inline.append((msg.data, msg.headers))

        async def on_queued(msg: Message) -> None:
            queued.append(msg.data)
            if len(queued) == 200:
                done.set()

        await subscribe_inline(conn._nc, "reader.inline", on_inline)
        await conn.subscribe("reader.queued", on_queued)
        await conn.flush()
        sent: list[tuple[bytes, dict[str, str] | None]] = []
        for n in range(200):
            # sizes from empty to several reads' worth (the reader reads 32 KiB at a time)
            body = bytes([n % 251]) * ((n * 977) % 70_000) + b"\r\nMSG x 1 1\r\n"
            headers = {"N": str(n)} if n % 5 == 0 else None
            await publisher.publish("reader.inline", body, headers=headers)
            await publisher.publish("reader.queued", body[:100])
            sent.append((body, headers))
        await publisher.flush()
        await asyncio.wait_for(done.wait(), 10)
        await conn.flush()
        assert inline == sent
        assert queued == [body[:100] for body, _ in sent]
    finally:
        await publisher.close()
        await conn.close()
