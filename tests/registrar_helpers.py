"""A registrar in its own OS process (``tests/registrar_process.py``), for the tests that
kill or stop one: what it prints is read on a thread, the lines of the instances it
marks down (``marks``) kept apart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

HERE = Path(__file__).parent


class RegistrarProcess:
    """``registrar_process.py URL REGISTRAR_ID LIVENESS_INTERVAL_SEC``; its standard error
    goes to ``stderr`` (a file), or is kept for :meth:`stop` to return."""

    def __init__(
        self, url: str, registrar_id: str, interval: float, stderr: IO[str] | None = None
    ) -> None:
        self.registrar_id = registrar_id
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "registrar_process.py"), url, registrar_id, str(interval)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if stderr is None else stderr,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())
            if line.startswith("READY"):
                self.ready.set()

    @property
    def marks(self) -> list[str]:
        """The lines of the instances it marked unhealthy or removed."""
        return [line for line in self.lines if line.startswith("UNHEALTHY")]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> str:
        """Stop it (a stopped one is continued first); its standard error, if kept."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
        try:
            _, err = self.proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err or ""
