"""A data-query agent process for the demo.

    python -m reach.demo.data_query URL AGENT_ID SATURATION_FILE CREDS

It logs in with the credentials file CREDS (bound to AGENT_ID). Its connection pool
"saturates" while SATURATION_FILE exists: the process stays alive and answers probes,
but its readiness says the pool is over 80 % used.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import sys
from typing import Any

from reach.agent.agent import Agent
from reach.wire.models import Readiness

MANIFEST: dict[str, Any] = {
    "agent_name": "data_query",
    "version": "1.4.0",
    "max_concurrency": 32,
    "capabilities": [
        {
            "name": "query_industry_data",
            "description": "Figures for an industry and time range",
            "input_schema": {
                "type": "object",
                "properties": {
                    "industry": {"type": "string"},
                    "time_range": {"type": "string"},
                },
                "required": ["industry", "time_range"],
            },
            "output_schema": {
                "type": "object",
                "properties": {
                    "rows": {"type": "integer", "minimum": 0},
                    "served_by": {"type": "string"},
                },
                "required": ["rows", "served_by"],
            },
            "tags": ["data-query", "industry", "sql"],
            "qps": 500,
            "latency_sla_ms": 200,
            "security_level": 2,
            "idempotent": True,
        }
    ],
    "health": {"interval_sec": 0.5, "timeout_sec": 0.25, "failures_before_unhealthy": 2},
}


async def main(url: str, agent_id: str, saturation_file: str, creds: str) -> None:
    # the demo shows the call it expects this agent to deny, not a log line of it
    logging.getLogger("reach.agent.serving").setLevel(logging.ERROR)

    def readiness() -> Readiness:
        if os.path.exists(saturation_file):
            return Readiness(
                ready=False, reason="connection pool 85% used", details={"db_pool_used": 0.85}
            )
        return Readiness(details={"db_pool_used": 0.2})

    agent = Agent(
        {**MANIFEST, "agent_id": agent_id}, servers=url, credentials=creds, readiness=readiness
    )

    @agent.capability("query_industry_data")
    async def query(req: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(random.uniform(0.005, 0.02))  # the database
        return {"rows": len(req["industry"]) * 100, "served_by": agent_id}

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with agent:
        print(f"READY {agent_id}", flush=True)
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
