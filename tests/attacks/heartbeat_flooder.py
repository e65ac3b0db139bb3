"""A heartbeat flood from one agent credential, in a process of its own (plain nats-py).

``python -m tests.attacks.heartbeat_flooder URL CREDS AGENT_ID INSTANCE_ID CAPABILITY
SECONDS`` logs in with the credential, gets a fabric token as any client may, and for
SECONDS publishes as fast as one connection goes, round-robin:

- heartbeats of its own agent id with a valid token, each one a change a registrar would
  write (load flipping between idle and saturated, a new readiness reason every time),
  and announces of its own instance again and again (each one would rewrite its record);
- heartbeats with a forged token; heartbeats that are not msgpack at all;
- heartbeats on other agents' subjects, mapped and partition ones (which NATS refuses);
- requests for call tokens, each one a signature if the issuer answered it.

It prints one JSON line: how many of each it sent and how many refusals NATS reported.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import time
from typing import Any

import msgpack
import nats

#: messages published between two yields to the event loop (nats-py flushes then)
BATCH = 200


def _envelope(body: dict[str, Any] | bytes, token: str | None) -> bytes:
    packed = body if isinstance(body, bytes) else msgpack.packb(body)
    env: dict[str, Any] = {"v": 1, "id": secrets.token_hex(8), "b": packed}
    if token is not None:
        env["tok"] = token
    data: bytes = msgpack.packb(env)
    return data


async def _token(nc: Any, client_id: str, secret: str) -> str:
    inbox = f"_INBOX.{client_id}.r.{secrets.token_hex(8)}"
    sub = await nc.subscribe(inbox + ".*", max_msgs=1)
    await nc.publish(
        "reach.v1.auth.token",
        _envelope({"client_id": client_id, "secret": secret}, None),
        reply=inbox + ".x",
    )
    msg = await sub.next_msg(timeout=10)
    reply = msgpack.unpackb(msg.data)
    return str(msgpack.unpackb(reply["b"])["token"])


async def main(
    url: str,
    creds: dict[str, Any],
    agent_id: str,
    instance_id: str,
    capability: str,
    seconds: float,
) -> dict[str, int]:
    client_id, secret = str(creds["client_id"]), str(creds["secret"])
    refused = 0

    async def on_error(exc: Exception) -> None:
        nonlocal refused
        refused += 1

    nc = await nats.connect(
        servers=[url],
        user=client_id,
        password=secret,
        inbox_prefix=f"_INBOX.{client_id}",
        allow_reconnect=False,
        error_cb=on_error,
        pending_size=64 * 1024 * 1024,
    )
    token = await _token(nc, client_id, secret)
    sent = {"material": 0, "announce": 0, "forged": 0, "garbage": 0, "elsewhere": 0, "tokens": 0}
    own = f"reach.v1.hb.{agent_id}"
    announce = f"reach.v1.announce.{agent_id}"
    manifest = {
        "agent_id": agent_id,
        "agent_name": "flood",
        "version": "1.0.0",
        "capabilities": [{"name": capability}],
    }
    reply = f"_INBOX.{client_id}.r.{secrets.token_hex(4)}.x"
    seq = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(BATCH):
            seq += 1
            kind = seq % 8
            if kind == 4:
                body = {
                    "manifest": manifest,
                    "instance_id": instance_id,
                    "started_at": time.time(),
                    "readiness": {"ready": True, "reason": secrets.token_hex(6)},
                }
                await nc.publish(announce, _envelope(body, token))
                sent["announce"] += 1
            elif kind < 4:
                body = {
                    "agent_id": agent_id,
                    "instance_id": instance_id,
                    "seq": seq,
                    "sent_at": time.time(),
                    "in_flight": 64 * (seq % 2),
                    "max_concurrency": 64,
                    "readiness": {"ready": True, "reason": secrets.token_hex(6)},
                }
                await nc.publish(own, _envelope(body, token), reply=reply if kind == 0 else "")
                sent["material"] += 1
            elif kind == 5:
                await nc.publish(own, _envelope(b"\x80", "eyJ" + secrets.token_hex(40)))
                sent["forged"] += 1
            elif kind == 6:
                await nc.publish(own, os.urandom(48))
                sent["garbage"] += 1
            elif seq % 16 < 8:
                victim = f"steady-{seq % 3 + 1}"
                subject = f"reach.v1.hb.{victim}" if seq % 32 < 16 else f"reach.v1.hbp.1.{victim}"
                await nc.publish(subject, _envelope(b"\x80", token))
                sent["elsewhere"] += 1
            else:
                exchange = {
                    "client_id": client_id,
                    "token": token,
                    "audience": "steady",
                    "instance": f"steady-{seq % 3 + 1}",
                }
                await nc.publish("reach.v1.auth.token", _envelope(exchange, None), reply=reply)
                sent["tokens"] += 1
        await asyncio.sleep(0)
    await nc.flush()
    await nc.close()
    return sent | {"refused": refused}


if __name__ == "__main__":
    url, creds, agent_id, instance_id, capability, seconds = sys.argv[1:7]
    with open(creds) as f:
        credentials = json.load(f)
    sent = asyncio.run(main(url, credentials, agent_id, instance_id, capability, float(seconds)))
    print(json.dumps(sent), flush=True)
