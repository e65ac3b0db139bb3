"""Running the `reach` command line as a real process from async tests: ``run_reach``
with the test's environment, ``reach_cli`` with one that does not pick up the
developer's fabric, in a directory and environment of the test's choosing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

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


#: the environment of a `reach` run that must not pick up the developer's fabric
CLEAN_ENV = {
    k: v for k, v in os.environ.items() if k not in ("REACH_URL", "REACH_CREDS", "COLUMNS")
}


async def reach_cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 60
) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``reach ARGS`` (piped, so not a terminal); killed
    if still running after ``timeout``."""
    proc = await asyncio.create_subprocess_exec(
        REACH,
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=CLEAN_ENV if env is None else env,
        cwd=cwd,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        pytest.fail(f"reach {' '.join(args)} still running after {timeout}s")
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@contextlib.asynccontextmanager
async def reach_serving(
    *args: str, ready: str, timeout: float = 60
) -> AsyncIterator[tuple[asyncio.subprocess.Process, re.Match[str]]]:
    """``reach ARGS``, a command that serves until told to stop (a gateway, the console),
    running while the block runs: the process, and the match of ``ready`` (a regular
    expression) in the first line it writes to stderr. Told to stop (SIGTERM) after the
    block unless it ended already, and killed if it does not within 20 s."""
    proc = await asyncio.create_subprocess_exec(
        REACH, *args,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE, env=CLEAN_ENV,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        line = (await asyncio.wait_for(proc.stderr.readline(), timeout)).decode()
        found = re.search(ready, line)
        assert found, line
        yield proc, found
    finally:
        if proc.returncode is None:
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 20)
        except TimeoutError:
            proc.kill()
            await proc.wait()
