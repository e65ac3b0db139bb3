"""docs/testing.md runs as printed: its files are written to an empty directory, where
pytest runs its tests (with the plugin of the installed package, and the page's
``pyproject.toml``: pytest-asyncio's auto mode; tests/test_testing_plugin.py runs the
fixtures in strict mode too) and Python its programs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from .doc_helpers import ROOT, blocks

DOC = ROOT / "docs" / "testing.md"
_TEST = re.compile(r"^(?:async )?def test_", re.MULTILINE)


def test_every_block_is_a_command_or_a_file_the_text_names() -> None:
    for block in blocks(DOC):
        assert block.lang in ("sh", "python", "yaml", "toml"), (
            f"{block}: tag it sh (commands), or python, yaml or toml (a file)"
        )
        if block.lang != "sh":
            assert block.title, f'{block}: a file: title it with its name (title="test_x.py")'
            assert f"`{block.title}`" in block.before, f"{block}: say which file it is"


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``command`` in ``cwd`` as a user's project runs it: this reach/ (either build), and
    nothing of this test run's environment (its pytest, xdist and REACH_* variables)."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("REACH_", "PYTEST_")) and name != "PYTHONPATH"
    }
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=150, check=False
    )


def test_every_example_runs(tmp_path: Path) -> None:
    files = {block.title: block.code for block in blocks(DOC) if block.title}
    for name, code in files.items():
        (tmp_path / name).write_text(code)
    tests = sum(len(_TEST.findall(code)) for name, code in files.items() if name[:5] == "test_")
    assert tests >= 10, "the page's tests were not all found"

    # -W error: a warning (an unclosed connection of a fixture's, say) fails the run too
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error"]
    ran = _run(pytest, tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    summary = ran.stdout.strip().splitlines()[-1]
    assert re.match(rf"{tests} passed in ", summary), ran.stdout

    programs = [n for n in files if n.endswith(".py") and not n.startswith("test_")]
    assert programs == ["fabric_demo.py"]
    for program in programs:
        ran = _run([sys.executable, program], tmp_path)
        assert ran.returncode == 0, f"{program}:\n{ran.stdout}{ran.stderr}"
        assert re.fullmatch(r"nats://127\.0\.0\.1:\d+ reg-\w+ 0\n", ran.stdout), ran.stdout
