"""Running the `reach` command line as a real process from async tests."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

#: the console script installed next to the interpreter running the tests
REACH = str(Path(sys.executable).parent / "reach")


async def run_reach(*args: str, timeout: float = 60) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``reach ARGS``."""
    proc = await asyncio.create_subprocess_exec(
        REACH, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()
