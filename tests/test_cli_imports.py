"""What a command line process imports: ``reach --help`` and every ``reach CMD --help``
load the command definitions only, not the stacks the commands run on (NATS, the
security and client stacks, the wire models, JSON Schema, rich); each command imports
what it uses when it runs. A module-level import of one of these in a command module
(reach/cli/*.py) fails here: import it inside the function that uses it.

Each check runs in a fresh interpreter, which lists its modules after the statement.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click

import reach
from reach.cli import main

from .manifest_helpers import MANIFEST_EXAMPLE

ROOT = str(Path(reach.__file__).resolve().parent.parent)  # this reach/, either build

#: third-party packages (and asyncio) that no help text needs
HEAVY = (
    "asyncio",
    "cryptography",
    "jsonschema",
    "jsonschema_rs",
    "jwt",
    "msgpack",
    "nats",
    "nkeys",
    "opentelemetry",
    "pydantic",
    "pydantic_core",
    "rich",
    "tenacity",
    "yaml",
)

#: the modules of reach a help text may load: the command modules and the few light
#: ones their options are built from (their choices, defaults and error types)
LIGHT = {
    "reach",
    "reach.audit",
    "reach.audit.events",
    "reach.audit.rulenames",
    "reach.errors",
    "reach.lazy",
    "reach.runtime",
    "reach.security",
    "reach.security.claims",
    "reach.settings",
    "reach.wire",
    "reach.wire.subjects",
    # the compiled build's one shared library, which a compiled light module (the audit's
    # event kinds) loads: it imports none of the modules compiled into it
    "reach._native__mypyc",
}


def _loaded_after(code: str, cwd: Path | None = None) -> list[str]:
    """The modules a fresh interpreter has loaded after running ``code``."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": ROOT, "NO_COLOR": "1"}
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    loaded: list[str] = json.loads(out.stdout.splitlines()[-1])
    return loaded


def _heavy(loaded: list[str]) -> list[str]:
    return sorted(name for name in loaded if name.split(".")[0] in HEAVY)


def _command_paths(group: click.Group, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = []
    for name, command in sorted(group.commands.items()):
        found.append((*path, name))
        if isinstance(command, click.Group):
            found += _command_paths(command, (*path, name))
    return found


def _help_of_every_command() -> str:
    """Code that prints ``reach --help`` and every ``reach CMD --help``, each of which
    must exit 0 and name its command."""
    paths = [(), *_command_paths(main)]
    return (
        "from click.testing import CliRunner\n"
        "from reach.cli import main\n"
        f"for path in {paths!r}:\n"
        "    result = CliRunner().invoke(main, [*path, '--help'], catch_exceptions=False)\n"
        "    assert result.exit_code == 0, (path, result.output)\n"
        "    assert 'Usage: main ' + ' '.join(path) in result.output, (path, result.output)\n"
    )


def test_the_help_of_every_command_loads_no_stack_it_does_not_show() -> None:
    loaded = _loaded_after(_help_of_every_command())
    assert _heavy(loaded) == []
    ours = {name for name in loaded if name.split(".")[0] == "reach"}
    commands = {name for name in ours if name.startswith("reach.cli")}
    assert ours - commands <= LIGHT, sorted(ours - commands - LIGHT)


def test_loading_the_command_group_loads_no_stack() -> None:
    # what the console script does before it parses anything
    loaded = _loaded_after("import reach.cli")
    assert _heavy(loaded) == []
    assert {n for n in loaded if n.split(".")[0] == "reach" and not n.startswith("reach.cli")} <= (
        LIGHT
    )


def test_validate_checks_a_manifest_without_nats_or_the_security_stack(tmp_path: Path) -> None:
    (tmp_path / "agent.yaml").write_text(MANIFEST_EXAMPLE, encoding="utf-8")
    code = (
        "from click.testing import CliRunner\n"
        "from reach.cli import main\n"
        "result = CliRunner().invoke(main, ['validate', 'agent.yaml'], catch_exceptions=False)\n"
        "assert result.exit_code == 0 and result.output.startswith('OK: '), result.output\n"
    )
    loaded = _loaded_after(code, cwd=tmp_path)
    # offline: what it needs is the manifest's models, YAML and JSON Schema
    for needed in ("reach.wire.models", "yaml", "jsonschema"):
        assert needed in loaded, needed
    for stack in ("nats", "jwt", "cryptography", "rich"):
        assert stack not in loaded, stack
    for package in ("reach.transport", "reach.security.", "reach.caller", "reach.agent"):
        assert not [n for n in loaded if n.startswith(package) and n not in LIGHT], package


def test_the_wire_models_load_json_schema_for_the_first_schema_checked() -> None:
    # a manifest without schemas, a registry record of one, an alert: nothing to check
    code = (
        "import sys\n"
        "from reach.wire.models import parse_manifest\n"
        "data = {'agent_id': 'a-1', 'agent_name': 'a', 'version': '1.0.0',\n"
        "        'capabilities': [{'name': 'x'}]}\n"
        "parse_manifest(data)\n"
        "assert 'jsonschema' not in sys.modules\n"
        "data['capabilities'][0]['input_schema'] = {'type': 'object'}\n"
        "parse_manifest(data)\n"
    )
    assert "jsonschema" in _loaded_after(code)
