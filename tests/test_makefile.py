"""What `make demo` does on a fresh clone: install the package and run the demo on plain
Python at once, without waiting for the compiled build (`make test` and `make bench`
make that), each install step saying what it does."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAKE = shutil.which("make")


def _dry_run(where: Path, target: str) -> list[str]:
    """The commands ``make TARGET`` would run in ``where`` (the checkout's Makefile)."""
    assert MAKE is not None
    # as a make of its own, not a sub-make of the `make test` that runs these tests (which
    # would hand it its flags and have it print the directories it enters)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    proc = subprocess.run(
        [MAKE, "-n", "--no-print-directory", "-f", str(ROOT / "Makefile"), target],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


@pytest.mark.skipif(MAKE is None, reason="needs make")
def test_a_fresh_clones_demo_runs_plain_python_without_compiling(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").touch()  # a clone: no .venv, no compiled modules
    (tmp_path / "reach").mkdir()
    (tmp_path / "setup.py").touch()
    commands = _dry_run(tmp_path, "demo")
    assert commands[-1] == ".venv/bin/reach demo"
    assert not [c for c in commands if "build_ext" in c or "mypyc" in c]
    assert not [c for c in commands if "[test" in c]  # nor the tools of tests and benchmarks
    said = [c for c in commands if c.startswith("echo ")]
    assert len(said) == 2  # the venv, the package: each step says what it does


@pytest.mark.skipif(MAKE is None, reason="needs make")
def test_once_a_build_was_made_the_demo_keeps_it_up_to_date(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").touch()
    (tmp_path / "reach").mkdir()
    (tmp_path / "setup.py").touch()
    venv = tmp_path / ".venv"
    (venv / "bin").mkdir(parents=True)
    built = time.time() - 60
    for name in ("bin/python", ".core", ".installed", ".native"):
        (venv / name).touch()
        os.utime(venv / name, (built, built))
    (tmp_path / "reach" / "client.py").touch()  # a source changed since the build
    commands = _dry_run(tmp_path, "demo")
    assert [c for c in commands if "build_ext" in c]
    assert commands[-1] == ".venv/bin/reach demo"
