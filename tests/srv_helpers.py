"""Asking NATS micro discovery (`$SRV`) as a tool does: one request, every answer."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import nats.errors
from nats.aio.client import Client as NatsClient


async def gather(
    nc: NatsClient, subject: str, want: int | None = None, timeout: float = 5.0
) -> list[Any]:
    """The answers to one request on ``subject``: until ``want`` came (None: every one
    that arrives), or ``timeout`` seconds passed, or the server said nobody listens."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    answers: list[Any] = []
    try:
        await nc.publish(subject, b"", reply=inbox)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (want is None or len(answers) < want) and (left := deadline - loop.time()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except nats.errors.TimeoutError:
                break
            if msg.headers and msg.headers.get("Status") == "503":
                break  # no responders: nobody listens on the subject
            answers.append(json.loads(msg.data))
    finally:
        await sub.unsubscribe()
    return answers
