"""The README runs as printed: every block, in order, in one shell, as a newcomer runs it;
so do the examples of docs/interoperability.md, against the quickstart's agent.

The blocks run in one bash session (``set -e -o pipefail``) started in an empty
temporary directory that stands for the clone: it holds only ``.venv``, a link to the
virtual environment running these tests. ``HOME`` is another empty directory (the
quickstart works under ``~``), no ``REACH_*`` variable is set, and tables are 80
columns wide.

* ``sh`` blocks go to the session as they are, but for three kinds of line: ``make T``
  (``T`` must be a Makefile target) and ``pip install`` are not run, since the session
  already runs in the environment they make (and ``make test`` would run this test);
  ``reach up`` gets ``--port`` with a free port. The ports the text names (4222,
  8080) become free ports throughout the text, since the machine's may be taken. A
  line ending in ``&`` must carry the comment ``wait for: "TEXT"``: the test waits for
  TEXT in the session's output before it runs the next line.
* A block titled with a file name (```` ```python title="agent.py" ````) is that file,
  written to the session's current directory; the sentence before it names the file.
* A ``text`` block titled ``output``: each of its lines must appear, in order, in what
  the session printed since the ``sh`` block before it started (``…`` stands for
  anything); any other ``text`` block, and a ``json`` block (a configuration to copy), is
  not run.

At the end, the background jobs the README started must all have ended: it stops them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from reach.fabric.embedded import free_port

from .doc_helpers import Block, blocks

#: an end-to-end run of whole programs: `make test-long` (CI runs it after `make test`)
pytestmark = pytest.mark.long

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
INTEROPERABILITY = ROOT / "docs" / "interoperability.md"
_WAIT = re.compile(r'&\s+# wait for: "([^"]+)"\s*$')
_PORTS = ("4222", "8080")


@pytest.mark.parametrize("path", [README, INTEROPERABILITY], ids=lambda p: p.name)
def test_every_block_says_what_it_is(path: Path) -> None:
    for block in blocks(path):
        assert block.lang in ("sh", "python", "yaml", "text", "json"), (
            f"{block}: tag it sh (commands), python or yaml (a file), or text"
        )
        if block.lang in ("python", "yaml"):
            assert block.title, f'{block}: a file: title it with its name (title="agent.py")'
            assert f"`{block.title}`" in block.before, f"{block}: say to save it as {block.title}"


class Session:
    """One bash reading the README's commands on its standard input; everything it and
    its background jobs print is collected."""

    def __init__(self, cwd: Path, env: dict[str, str], home: Path) -> None:
        self.home = home
        #: the ports the text names, and the free ports that stand for them
        self.ports = {default: str(free_port()) for default in _PORTS}
        self.proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._out: list[str] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._sent = 0
        self.send("set -e -o pipefail\n")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            with self._lock:
                self._out.append(raw.decode(errors="replace"))

    @property
    def output(self) -> str:
        with self._lock:
            return "".join(self._out)

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode())
        self.proc.stdin.flush()

    def run(self, commands: str, what: object, timeout: float = 120) -> Path:
        """Run ``commands``; the session's directory after them. Fails when one fails."""
        self._sent += 1
        done = f"__done_{self._sent}__"
        self.send(f'{commands}\nprintf "\\n%s %s\\n" {done} "$PWD"\n')
        found = self.wait_for(re.compile(rf"^{done} (.*)$", re.MULTILINE), what, timeout)
        return Path(found.group(1))

    def wait_for(self, pattern: re.Pattern[str], what: object, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            found = pattern.search(self.output)
            if found:
                return found
            if self.proc.poll() is not None:
                pytest.fail(f"{what}: the shell exited ({self.proc.returncode}):\n{self.output}")
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: no {pattern.pattern!r} within {timeout} s:\n{self.output}")
            time.sleep(0.05)

    def stop(self) -> None:
        """End the shell and whatever the README left running (its process group)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._reader.join(15)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Session]:
    clone, home = tmp_path / "clone", tmp_path / "home"
    clone.mkdir()
    home.mkdir()
    (clone / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("REACH_")}
    env["HOME"] = str(home)
    env["COLUMNS"] = "80"  # tables as the narrowest usual terminal shows them
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if Path(p) != Path(sys.prefix) / "bin"
    )
    shell = Session(clone, env, home)
    try:
        yield shell
    finally:
        shell.stop()


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][\w-]*):", text, flags=re.MULTILINE))


def _chunks(block: Block, ports: dict[str, str]) -> list[tuple[str, str | None]]:
    """The block's commands as the session runs them: runs of lines, each but the last
    ending with a background command and the text to wait for after it."""
    chunks: list[tuple[str, str | None]] = []
    lines: list[str] = []
    for raw in block.code.splitlines():
        words = shlex.split(raw, comments=True)
        if words[:1] == ["make"]:
            assert words[1] in _make_targets(), f"{block}: no Makefile target {words[1]}"
            continue
        if words[:2] == ["pip", "install"]:
            continue
        if words[:2] == ["reach", "up"] and "--port" not in words:
            raw = raw.replace("reach up", f"reach up --port {ports['4222']}", 1)
        lines.append(raw)
        background = _WAIT.search(raw)
        if background:
            chunks.append(("\n".join(lines), background.group(1)))
            lines = []
        else:
            assert not words or words[-1] != "&", f'{block}: say what to wait for: # wait for: "…"'
    if lines:
        chunks.append(("\n".join(lines), None))
    return chunks


def _check_output(expected: Block, session: Session, since: int) -> None:
    """Every line of ``expected`` in what the session printed from ``since`` on, in order
    (``…`` matches anything); output that comes after the command (a background job's)
    is waited for."""
    wanted = expected.code.splitlines()
    deadline = time.monotonic() + 30
    while (missing := _first_missing(wanted, session.output[since:])) is not None:
        if time.monotonic() > deadline:
            printed = session.output[since:]
            pytest.fail(f"{expected}: {missing!r} not printed; the session printed:\n{printed}")
        time.sleep(0.1)


def _first_missing(wanted: list[str], printed: str) -> str | None:
    lines = printed.splitlines()
    at = 0
    for want in wanted:
        pieces = [" ".join(p.split()) for p in want.split("…") if p.strip()]
        while at < len(lines) and not _in_order(pieces, " ".join(lines[at].split())):
            at += 1
        if at == len(lines):
            return want
        at += 1
    return None


def _in_order(pieces: list[str], line: str) -> bool:
    start = 0
    for piece in pieces:
        found = line.find(piece, start)
        if found < 0:
            return False
        start = found + len(piece)
    return True


def _run(session: Session, path: Path) -> None:
    """Every block of ``path`` in order, in the session, as its text says."""
    since = 0
    cwd = session.run("true", f"{path.name}: the shell")
    for block in blocks(path, session.ports):
        if block.lang == "sh":
            since = len(session.output)
            for commands, wait in _chunks(block, session.ports):
                cwd = session.run(commands, block)
                if wait is not None:
                    session.wait_for(re.compile(re.escape(wait)), block, 60)
        elif block.title == "output":
            _check_output(block, session, since)
        elif block.title is not None:
            (cwd / block.title).write_text(block.code)
    # the text stopped what it started: nothing left for `wait` to wait for
    session.run("wait", f"{path.name}: the jobs it started, stopped", timeout=60)


def test_the_readme_runs_as_printed(session: Session) -> None:
    _run(session, README)


def test_the_interoperability_examples_run_as_printed(session: Session) -> None:
    """They run where the quickstart left its files: ~/reach-hello, with agent.yaml and
    agent.py as the README's blocks have them."""
    hello = session.home / "reach-hello"
    hello.mkdir()
    for block in blocks(README):
        if block.lang in ("python", "yaml") and block.title is not None:
            (hello / block.title).write_text(block.code)
    _run(session, INTEROPERABILITY)
