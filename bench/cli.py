"""``python -m bench.cli [--quick] [--runs N] [--out FILE]``: how long the command line
takes to answer, each command a fresh process, as a person at a terminal waits for it.

In a temporary directory it starts a local fabric (``reach up`` on a free port), the
agent of the README (``agent.py`` serving ``generate_industry_report`` from its
``agent.yaml``) and makes a few calls, so that ``reach agents`` has a row and a p99 to
show. Then every command below runs ``--runs`` times (default 10), in rounds: each round
runs every command once, so that all of them see the same minutes of a shared machine.
Each run is timed from start to exit (wall) with its CPU time (user + system, from the
kernel's account of the child: less moved by other processes' load than the wall time).

The baselines: ``python -c pass`` (the interpreter alone), the NATS CLI's ``nats --help``
when ``nats`` is installed (skipped otherwise), and an import of the libraries that
``reach validate`` (click, PyYAML, pydantic, jsonschema) and ``reach agents`` (asyncio,
click, rich, msgpack, nats-py, pydantic, PyJWT for its token, jsonschema for the records'
schemas) cannot do without, with one pydantic model made: the least either command can
take. Commands run as
``python -m reach`` with this tree's ``reach`` first on the path; each is run once
untimed first, with a bytecode cache of the benchmark's own, so that what is timed is a
start with compiled bytecode, as an installed package starts (and not Python compiling
the sources, when the environment turns bytecode files off).

Targets (median wall time): ``reach --help`` ≤ 150 ms, ``reach validate`` ≤ 300 ms,
``reach agents`` ≤ 400 ms. Writes bench/results/cli.json and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.callpath import server_version
from bench.report import _table, machine_info, require_fresh_build, spread, write_json

__all__ = ["COMMANDS", "DEFAULT_RUNS", "QUICK_RUNS", "Command", "main", "measure"]

_ROOT = Path(__file__).resolve().parent.parent
_OUT = _ROOT / "bench" / "results" / "cli.json"
DEFAULT_RUNS = 10
QUICK_RUNS = 2
#: how long the fabric and the agent may take to say they are up
_START_TIMEOUT = 60.0
#: a command that takes longer than this is stuck, not slow
_RUN_TIMEOUT = 120.0

CAPABILITY = "generate_industry_report"
REQUEST = json.dumps({"industry": "ev", "time_range": "2025Q3"})

#: the README's manifest and agent (a first agent, as a newcomer writes it)
MANIFEST = f"""\
agent_id: report-gen-001
agent_name: report_generator
version: 2.3.1
capabilities:
  - name: {CAPABILITY}
    description: Structured report for an industry and time range
    input_schema:
      type: object
      properties:
        industry: {{type: string}}
        time_range: {{type: string}}
      required: [industry, time_range]
    output_schema:
      type: object
      properties:
        report_id: {{type: string}}
        status: {{type: string}}
    tags: [report-generate, industry]
    latency_sla_ms: 500
    security_level: 2
"""
AGENT = f"""\
import asyncio

from reach import Agent

agent = Agent.from_yaml("agent.yaml")

@agent.capability("{CAPABILITY}")
async def generate(req: dict) -> dict:
    return {{"report_id": f"{{req['industry']}}-{{req['time_range']}}", "status": "done"}}

async def main() -> None:
    async with agent:
        print(f"serving {{agent.agent_id}}", flush=True)
        await agent.serve_forever()

asyncio.run(main())
"""


@dataclass(frozen=True)
class Command:
    label: str
    #: the arguments after the interpreter (``python``), or the whole command with ``exe``
    args: tuple[str, ...]
    #: the median wall time it should answer within, milliseconds
    target_ms: float | None = None
    #: a program other than this interpreter (a baseline); skipped when not installed
    exe: str | None = None


#: the libraries each of two commands cannot do without, imported, and one pydantic model
#: made (what validating with pydantic takes before the first model): the least a fresh
#: process running that command can take on this machine
_ONE_MODEL = "\nclass M(pydantic.BaseModel):\n    x: int = 0"
VALIDATE_NEEDS = "import click, yaml, pydantic, jsonschema" + _ONE_MODEL
AGENTS_NEEDS = (
    "import asyncio, click, rich.table, msgpack, nats.js, pydantic, jwt, jsonschema" + _ONE_MODEL
)

COMMANDS = (
    Command("python -c pass", ("-c", "pass")),
    Command("nats --help", ("--help",), exe="nats"),
    Command("libraries reach validate needs", ("-c", VALIDATE_NEEDS)),
    Command("libraries reach agents needs", ("-c", AGENTS_NEEDS)),
    Command("import reach", ("-c", "import reach")),
    Command("from reach import Agent, ReachClient", ("-c", "from reach import Agent, ReachClient")),
    Command("reach --help", ("-m", "reach", "--help"), target_ms=150),
    Command("reach agents --help", ("-m", "reach", "agents", "--help")),
    Command("reach validate agent.yaml", ("-m", "reach", "validate", "agent.yaml"), target_ms=300),
    # a call before each `reach agents`: its p99 column has the last minute's calls to show
    Command(f"reach call {CAPABILITY} JSON", ("-m", "reach", "call", CAPABILITY, REQUEST)),
    Command("reach agents", ("-m", "reach", "agents"), target_ms=400),
    Command(f"reach doctor {CAPABILITY}", ("-m", "reach", "doctor", CAPABILITY)),
)


@dataclass
class Samples:
    wall_ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)


def _child_env(directory: Path) -> dict[str, str]:
    """This tree's ``reach`` first on the path, bytecode cached in ``directory``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(_ROOT) + (os.pathsep + path if path else "")
    env["PYTHONPYCACHEPREFIX"] = str(directory / "pycache")
    env["NO_COLOR"] = "1"
    return env


def _argv(command: Command) -> list[str]:
    return [command.exe or sys.executable, *command.args]


def _run_once(command: Command, cwd: Path, env: dict[str, str]) -> tuple[float, float, str]:
    """(wall ms, CPU ms, standard output) of one run; SystemExit with its output if it
    failed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run(
        _argv(command), cwd=cwd, env=env, capture_output=True, timeout=_RUN_TIMEOUT, check=False
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        out = (proc.stdout + proc.stderr).decode(errors="replace")[-2000:]
        raise SystemExit(f"bench.cli: {command.label} exited {proc.returncode}:\n{out}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall * 1000, cpu * 1000, proc.stdout.decode(errors="replace")


@contextlib.contextmanager
def _process(
    name: str, argv: Sequence[str], cwd: Path, env: dict[str, str], ready: str
) -> Iterator[None]:
    """A background process, until the context ends (SIGINT, then killed if it lingers);
    entered once its output has a line that starts with ``ready``."""
    log = cwd / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            _wait_for(proc, log, ready)
            yield
        finally:
            _stop(proc)


def _wait_for(proc: subprocess.Popen[bytes], log: Path, ready: str) -> None:
    """Until the process's output has the ``ready`` line; SystemExit with the output if it
    ends or takes longer than the start timeout."""
    deadline = time.monotonic() + _START_TIMEOUT
    while time.monotonic() < deadline:
        said = log.read_text(errors="replace")
        if any(line.startswith(ready) for line in said.splitlines()):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    said = log.read_text(errors="replace")[-2000:]
    raise SystemExit(f"bench.cli: {log.stem} did not start:\n{said}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def _fabric(cwd: Path, env: dict[str, str], progress: Any) -> Iterator[str]:
    """``reach up`` on a free port in ``cwd`` and the README's agent on it, until the
    context ends; yields the server's URL."""
    from reach.fabric.embedded import free_port

    (cwd / "agent.yaml").write_text(MANIFEST)
    (cwd / "agent.py").write_text(AGENT)
    port = free_port()
    up = [sys.executable, "-m", "reach", "up", "--port", str(port)]
    with _process("up", up, cwd, env, "Agent-Reach up:"):
        progress(f"fabric up on port {port} in {cwd}")
        with _process("agent", [sys.executable, "agent.py"], cwd, env, "serving"):
            yield f"nats://127.0.0.1:{port}"


def _warm_up(commands: Sequence[Command], cwd: Path, env: dict[str, str]) -> None:
    """Each command once, untimed: its bytecode compiled and cached, its files read; and
    ``reach agents`` lists the agent (what is timed is a table with a row)."""
    for command in commands:
        _, _, said = _run_once(command, cwd, env)
        if command.args[-1:] == ("agents",) and "report-gen-001" not in said:
            raise SystemExit(f"bench.cli: reach agents does not list the agent:\n{said}")


def measure(runs: int, progress: Any = print) -> tuple[dict[str, Samples], list[str], str]:
    """Samples by command label, the labels skipped (program not installed), and the
    nats-server's version."""
    todo = [c for c in COMMANDS if c.exe is None or shutil.which(c.exe)]
    skipped = [c.label for c in COMMANDS if c not in todo]
    samples = {c.label: Samples() for c in todo}
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as tmp:
        cwd = Path(tmp)
        env = _child_env(cwd)
        with _fabric(cwd, env, progress) as url:
            version = server_version(url)
            _warm_up(todo, cwd, env)
            for n in range(runs):
                for command in todo:
                    wall, cpu, _ = _run_once(command, cwd, env)
                    samples[command.label].wall_ms.append(wall)
                    samples[command.label].cpu_ms.append(cpu)
                progress(f"round {n + 1}/{runs} done")
    return samples, skipped, version


def _rounded(values: Sequence[float]) -> dict[str, Any]:
    s = spread([round(v, 1) for v in values])
    return {k: s[k] for k in ("median", "min", "max", "per_rep")}


def build_rows(samples: dict[str, Samples]) -> list[dict[str, Any]]:
    rows = []
    for command in COMMANDS:
        if command.label not in samples:
            continue
        wall = _rounded(samples[command.label].wall_ms)
        met = None if command.target_ms is None else wall["median"] <= command.target_ms
        rows.append(
            {
                "command": command.label,
                "argv": [command.exe or "python", *command.args],
                "wall_ms": wall,
                "cpu_ms": _rounded(samples[command.label].cpu_ms),
                "target_ms": command.target_ms,
                "met": met,
            }
        )
    return rows


def format_table(rows: Sequence[dict[str, Any]], runs: int) -> str:
    def target(row: dict[str, Any]) -> str:
        if row["target_ms"] is None:
            return ""
        return f"≤ {row['target_ms']:g} ms: {'met' if row['met'] else 'NOT met'}"

    body = [
        [
            row["command"],
            f"{row['wall_ms']['median']:.0f}",
            f"{row['wall_ms']['min']:.0f}–{row['wall_ms']['max']:.0f}",
            f"{row['cpu_ms']['median']:.0f}",
            target(row),
        ]
        for row in rows
    ]
    title = f"Each command a fresh process, {runs} runs: median wall ms (min–max), CPU ms"
    header = ["command", "wall ms", "min–max", "CPU ms", "target"]
    return _table(title, header, body)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cli", description=__doc__)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_RUNS} runs (a smoke run)")
    parser.add_argument("--runs", type=int, help=f"runs of each command ({DEFAULT_RUNS})")
    parser.add_argument("--out", type=Path, default=_OUT, help="JSON results file")
    args = parser.parse_args(argv)
    require_fresh_build()
    runs = args.runs if args.runs is not None else QUICK_RUNS if args.quick else DEFAULT_RUNS
    if runs < 1:
        parser.error("--runs must be >= 1")
    samples, skipped, version = measure(runs, lambda line: print(line, file=sys.stderr))
    rows = build_rows(samples)
    print(format_table(rows, runs))
    if skipped:
        print(f"skipped (not installed): {', '.join(skipped)}")
    doc = {
        "benchmark": "cli",
        "format": 1,
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python -m bench.cli " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine_info(version),
        "settings": {"runs": runs},
        "commands": rows,
        "skipped": skipped,
    }
    write_json(doc, args.out)
    print(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
