"""An agent in its own OS process, for tests about processes (kill, hang, restart).

    python tests/agent_process.py URL MANIFEST_JSON [--not-ready-file PATH] [--delay-ms N]

Prints ``READY <agent_id>`` once registered, or ``REFUSED <reason>`` and exits 3.
Readiness is false while --not-ready-file exists. Handlers echo their input.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from typing import Any

from reach.agent.agent import Agent
from reach.errors import RegistrationRefused
from reach.wire.models import Readiness


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("manifest")
    parser.add_argument("--not-ready-file", default=None)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    args = parser.parse_args()

    def readiness() -> Readiness:
        if args.not_ready_file and os.path.exists(args.not_ready_file):
            return Readiness(ready=False, reason="connection pool 85% used", details={"pool": 0.85})
        return Readiness()

    agent = Agent(json.loads(args.manifest), servers=args.url, readiness=readiness)
    for cap in agent.manifest.capabilities:

        async def echo(req: Any, _name: str = cap.name) -> Any:
            if args.delay_ms:
                await asyncio.sleep(args.delay_ms / 1000)
            return {"echo": req, "by": agent.agent_id, "capability": _name}

        agent.capability(cap.name)(echo)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    try:
        async with agent:
            print(f"READY {agent.agent_id}", flush=True)
            await stop.wait()
    except RegistrationRefused as exc:
        print(f"REFUSED {exc.reason}", flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
