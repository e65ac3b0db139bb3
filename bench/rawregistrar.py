"""``python -m bench.rawregistrar URL PREFIX COUNT PROBES_PER_SEC``: a registrar's
traffic moved by plain nats-py and nothing else, the floor under ``bench.discovery``'s
registrar load (part 3).

It answers every heartbeat on the partition subjects with the registrar's own ok reply
(the same bytes, nothing decoded, no registry), and probes the simulated instances
``PREFIX-0`` … ``PREFIX-(COUNT-1)`` in turn at ``PROBES_PER_SEC`` with the registrar's
probe request, counting the replies on one inbox subscription (nothing decoded). Written
as a nats-py user would write it: ``subscribe`` with a callback, ``msg.respond``,
``publish`` with a reply subject.

Its CPU is what the registrar's message rates cost in nats-py alone: the part of the
registrar's CPU that no registrar logic can take away, measured beside it by
``bench.discovery`` on the same simulated instances, at the rates the registrar had.

On standard input: ``STATS`` prints ``STATS {json}`` (heartbeats answered, probes sent,
probe replies, since the last ``STATS``); closing it stops the process.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]

#: how often the probe loop wakes up to send the probes due since its last turn
_TICK_SEC = 0.01


async def _run(url: str, prefix: str, count: int, probes_per_sec: float) -> None:
    import nats

    from reach.registry.probes import probe_request
    from reach.wire import envelope, subjects
    from reach.wire.modelcodec import encode_model
    from reach.wire.models import HeartbeatReply

    nc = await nats.connect(url, name="bench-raw-registrar")
    ok = envelope.pack_ok(encode_model(HeartbeatReply(ok=True)), "raw-registrar")
    request = probe_request("0123456789abcdef")
    counts = {"heartbeats": 0, "probes": 0, "probe_replies": 0}

    async def on_heartbeat(msg: Any) -> None:
        counts["heartbeats"] += 1
        await msg.respond(ok)

    async def on_probe_reply(msg: Any) -> None:
        counts["probe_replies"] += 1

    inbox = nc.new_inbox()
    await nc.subscribe(f"{subjects.HEARTBEAT_PARTITION_PREFIX}.>", cb=on_heartbeat)
    await nc.subscribe(f"{inbox}.*", cb=on_probe_reply)
    await nc.flush()

    async def probe_loop() -> None:
        probe_subjects = [subjects.probe(f"{prefix}-{n}") for n in range(count)]
        replies = [f"{inbox}.{n}" for n in range(count)]
        started = time.monotonic()
        sent = 0
        n = 0
        while True:
            due = int((time.monotonic() - started) * probes_per_sec)
            while sent < due:
                await nc.publish(probe_subjects[n], request, reply=replies[n])
                counts["probes"] += 1
                sent += 1
                n = (n + 1) % count
            await asyncio.sleep(_TICK_SEC)

    prober = asyncio.create_task(probe_loop())
    print("READY", flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := await reader.readline():
            if line.strip() == b"STATS":
                print(f"STATS {json.dumps(counts)}", flush=True)
                for key in counts:
                    counts[key] = 0
    finally:
        prober.cancel()
        await nc.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    url, prefix, count, rate = args
    asyncio.run(_run(url, prefix, int(count), float(rate)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
