"""A registrar in its own OS process, for tests that kill one (SIGKILL).

    python tests/registrar_process.py URL REGISTRAR_ID LIVENESS_INTERVAL_SEC

Prints ``READY <registrar_id>`` once started; stops on SIGTERM, or when its stdin closes
(the test died), and prints ``UNHEALTHY <agent_id> <reason>`` for every instance it marks
unhealthy or evicts, so the test counts them.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time

from reach.registry import Registrar, RegistrarConfig
from reach.transport import connect


class _Marks(logging.Handler):
    """Prints what the registrar marks down (its log lines of status changes, evictions)."""

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "→ unhealthy" in text or text.startswith("removed "):
            print(f"UNHEALTHY {text}", flush=True)
        elif "heartbeat partitions" in text:
            print(f"PARTITIONS {time.time():.3f} {text}", flush=True)


async def main() -> None:
    url, registrar_id, interval = sys.argv[1], sys.argv[2], float(sys.argv[3])
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("reach.registrar").addHandler(_Marks())
    logging.getLogger("reach.registrar").setLevel(logging.INFO)
    conn = await connect([url], name=registrar_id)
    config = RegistrarConfig(
        registrar_id=registrar_id,
        liveness_interval_sec=interval,
        new_agent_window_sec=0.0,
        alerts=None,
    )
    registrar = Registrar(conn, config)
    await registrar.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_reader(sys.stdin.fileno(), lambda: stop.set() if not sys.stdin.read(1) else None)
    print(f"READY {registrar_id}", flush=True)
    await stop.wait()
    await registrar.stop()
    await conn.close()


if __name__ == "__main__":
    asyncio.run(main())
