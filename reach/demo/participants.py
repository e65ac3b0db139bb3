"""Who takes part in the demo: its fabric, a credential for each participant, and the
data-query agents, each a process of its own."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from reach.fabric import Fabric
from reach.fabric.embedded import die_with_parent

__all__ = ["DATA_QUERIES", "LEVEL", "REPORT_ID", "DataQueryProcess", "demo_fabric"]

#: the report agent, which the scheduler calls and which calls the data-query agents
REPORT_ID = "industry-report-1"
#: the data-query instances of the run: two at the start, the third replaces one
DATA_QUERIES = ("data-query-1", "data-query-2", "data-query-3")
#: clearance of the demo's callers, and what the capabilities require
LEVEL = 2


class DataQueryProcess:
    """``python -m reach.demo.data_query``: a data-query agent in a process of its own,
    logged in with the credentials file ``creds``."""

    def __init__(self, url: str, agent_id: str, workdir: Path, creds: Path) -> None:
        self.agent_id = agent_id
        self.saturation_file = workdir / f"{agent_id}.saturated"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "reach.demo.data_query",
                url,
                agent_id,
                str(self.saturation_file),
                str(creds),
            ],
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=die_with_parent(os.getpid()),
        )

    async def ready(self) -> None:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), 20)
        if not line.startswith("READY"):
            raise RuntimeError(f"{self.agent_id} did not start: {line!r}")

    def saturate(self, on: bool) -> None:
        if on:
            self.saturation_file.touch()
        else:
            self.saturation_file.unlink(missing_ok=True)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@asynccontextmanager
async def demo_fabric(workdir: Path) -> AsyncIterator[Fabric]:
    """The demo's fabric, the one ``reach up`` starts: its own nats-server (a free port,
    the store under ``workdir``) with logins on; with a credential for each participant
    in ``<store>/<id>.creds``: the data-query and report agents' bound to their agent_id
    and capability, the scheduler's a plain caller's, one below the clearance the
    capabilities require (``intern``), and ``admin.creds`` for the operator's view. The
    registrar part runs in this process: the alerts it raises are the demo's to show,
    not log lines."""
    async with Fabric(workdir / "store") as fabric:
        for agent_id in DATA_QUERIES:
            await fabric.add_client(
                agent_id, LEVEL, agent_id=agent_id, capabilities=["query_industry_data"]
            )
        await fabric.add_client(
            REPORT_ID, LEVEL, agent_id=REPORT_ID, capabilities=["generate_industry_report"]
        )
        await fabric.add_client("scheduler", LEVEL)
        await fabric.add_client("intern", LEVEL - 1)
        yield fabric
