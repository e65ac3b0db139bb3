"""Every code snippet in README.md runs, in order, against a real `reach up` fabric.

How each fenced block is executed:

* ``yaml`` — parsed; a manifest (it has ``agent_id``) is written to ``agent.yaml`` and
  must pass ``reach validate``.
* ``python`` — run as its own process in the working directory. A snippet that serves
  forever (``serve_forever``) is started in the background and must register; a snippet
  defining pytest tests is run with pytest; any other must exit 0 (top-level ``await``
  is allowed, as in the README).
* ``sh`` — line by line: ``reach ...`` commands run against the fabric and must exit 0
  (a following ``-f`` command must still be running after two seconds: it follows; a
  server started with a trailing ``&`` must print its first line and keep running, and
  is stopped when the snippets are done);
  ``make`` lines must name a Makefile target (running ``make test`` inside the tests
  would recurse; the targets themselves are what CI runs); pipes run through bash.
* ``text`` — diagrams and sample output: not code, not run.

The fabric is ``reach up`` on a free port, started in a temporary directory, so the
README's defaults (``.reach/dev.creds`` found by itself) hold; ``REACH_URL`` points at it.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from reach.embedded import free_port

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BIN = Path(sys.executable).parent
REACH = str(BIN / "reach")
_FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass(frozen=True)
class Snippet:
    line: int
    lang: str
    code: str

    def __str__(self) -> str:
        return f"README.md:{self.line} ({self.lang or 'no language'})"


def snippets(text: str) -> list[Snippet]:
    found: list[Snippet] = []
    lang: str | None = None
    start = 0
    body: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if match and lang is None:
            lang, start, body = match.group(1), n, []
        elif line.strip() == "```" and lang is not None:
            found.append(Snippet(start, lang, "\n".join(body) + "\n"))
            lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"README.md:{start}: unclosed code block"
    return found


def test_every_block_says_what_it_is() -> None:
    for snippet in snippets(README.read_text()):
        assert snippet.lang in ("python", "yaml", "sh", "text"), (
            f"{snippet}: tag it python, yaml, sh (run by this test) or text (not code)"
        )


@dataclass
class Fabric:
    cwd: Path
    env: dict[str, str]
    url: str


@pytest.fixture
def fabric(tmp_path: Path) -> Iterator[Fabric]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("REACH_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    url = f"nats://127.0.0.1:{port}"
    log = tmp_path / "reach-up.log"
    with log.open("wb") as out:
        up = subprocess.Popen(
            [REACH, "up", "--port", str(port)],
            cwd=tmp_path,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / ".reach" / "dev.creds").exists():
            assert up.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "reach up did not create .reach/dev.creds"
            time.sleep(0.05)
        _wait_ok([REACH, "agents", "--servers", url], tmp_path, env)
        yield Fabric(tmp_path, {**env, "REACH_URL": url}, url)
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()


def _wait_ok(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while True:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode == 0:
            return proc.stdout
        if time.monotonic() > deadline:
            pytest.fail(f"{' '.join(cmd)} kept failing: {proc.stderr or proc.stdout}")
        time.sleep(0.2)


_RUNNER = """
import ast, asyncio, sys
source = open(sys.argv[1]).read()
code = compile(source, sys.argv[2], "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
result = eval(code, {"__name__": "__main__"})
if asyncio.iscoroutine(result):
    asyncio.run(result)
"""


def _run_python(
    snippet: Snippet, fabric: Fabric, background: list[subprocess.Popen[bytes]]
) -> None:
    path = fabric.cwd / f"snippet_{snippet.line}.py"
    path.write_text(snippet.code)
    if "def test_" in snippet.code:
        _run_ok(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
            snippet,
            fabric,
        )
        return
    cmd = [sys.executable, "-c", _RUNNER, str(path), str(snippet)]
    if "serve_forever" in snippet.code:
        log = fabric.cwd / f"snippet_{snippet.line}.log"
        with log.open("wb") as out:
            agent = subprocess.Popen(
                cmd, cwd=fabric.cwd, env=fabric.env, stdout=out, stderr=subprocess.STDOUT
            )
        background.append(agent)
        ids = re.findall(r"agent_id: (\S+)", (fabric.cwd / "agent.yaml").read_text())
        deadline = time.monotonic() + 30
        while not all(i in _wait_ok([REACH, "agents"], fabric.cwd, fabric.env) for i in ids):
            assert agent.poll() is None, f"{snippet} exited: {log.read_text()}"
            assert time.monotonic() < deadline, f"{snippet}: agent never registered"
            time.sleep(0.2)
        return
    _run_ok(cmd, snippet, fabric)


def _run_ok(cmd: list[str], snippet: Snippet, fabric: Fabric) -> None:
    """Run ``cmd`` in the fabric's directory; it must exit 0 within two minutes."""
    proc = subprocess.run(
        cmd,
        cwd=fabric.cwd,
        env=fabric.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"{snippet}:\n{proc.stdout}\n{proc.stderr}"


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][\w-]*):", text, flags=re.MULTILINE))


def _start_server(
    words: list[str], snippet: Snippet, fabric: Fabric, background: list[subprocess.Popen[bytes]]
) -> None:
    """A server the snippet starts in the background: up once it printed a line."""
    server = subprocess.Popen(
        [REACH, *words[1:]],
        cwd=fabric.cwd,
        env=fabric.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    background.append(server)
    assert server.stdout is not None
    ready, _, _ = select.select([server.stdout], [], [], 30)
    first = server.stdout.readline() if ready else b""
    assert server.poll() is None, f"{snippet}: {' '.join(words)} exited: {first!r}"
    assert first, f"{snippet}: {' '.join(words)} printed nothing within 30 s"


def _run_sh(snippet: Snippet, fabric: Fabric, background: list[subprocess.Popen[bytes]]) -> None:
    for raw in snippet.code.splitlines():
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        words = shlex.split(line)
        if words[0] == "make":
            assert words[1] in _make_targets(), f"{snippet}: no Makefile target {words[1]}"
            continue
        if words[0] == ".venv/bin/reach":
            words[0] = "reach"
        assert words[0] == "reach", f"{snippet}: run only reach and make commands ({line!r})"
        if words[1] == "up":
            # the fabric is already up: the options must exist
            proc = subprocess.run(
                [REACH, "up", "--help"], capture_output=True, text=True, check=False
            )
            for option in re.findall(r"--[a-z-]+", line):
                assert option in proc.stdout, f"{snippet}: reach up has no {option}"
            continue
        if words[-1] == "&":
            _start_server(words[:-1], snippet, fabric, background)
            continue
        if "-f" in words or "--follow" in words:
            follower = subprocess.Popen(
                ["bash", "-c", line],
                cwd=fabric.cwd,
                env=fabric.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            time.sleep(2)
            still = follower.poll() is None
            os.killpg(follower.pid, signal.SIGTERM)
            _, err = follower.communicate(timeout=10)
            assert still, f"{snippet}: {line!r} stopped instead of following: {err!r}"
            continue
        proc = subprocess.run(
            ["bash", "-o", "pipefail", "-c", line],
            cwd=fabric.cwd,
            env=fabric.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 0, f"{snippet}: {line!r} failed:\n{proc.stdout}{proc.stderr}"


def _run_yaml(snippet: Snippet, fabric: Fabric) -> None:
    data = yaml.safe_load(snippet.code)
    if isinstance(data, dict) and "agent_id" in data:
        (fabric.cwd / "agent.yaml").write_text(snippet.code)
        proc = subprocess.run(
            [REACH, "validate", "agent.yaml"],
            cwd=fabric.cwd,
            env=fabric.env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert proc.returncode == 0, f"{snippet}: {proc.stdout}{proc.stderr}"


def test_every_snippet_runs_in_order_against_a_real_fabric(fabric: Fabric) -> None:
    background: list[subprocess.Popen[bytes]] = []
    try:
        for snippet in snippets(README.read_text()):
            if snippet.lang == "python":
                _run_python(snippet, fabric, background)
            elif snippet.lang == "sh":
                _run_sh(snippet, fabric, background)
            elif snippet.lang == "yaml":
                _run_yaml(snippet, fabric)
    finally:
        for proc in background:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(15)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:  # a server's, read up to its first line
                proc.stdout.close()
