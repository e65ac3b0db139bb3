"""The command line's help and its answer to a mistyped command: every command's summary
is a whole sentence that fits, and an unknown command is answered with the closest."""

from __future__ import annotations

import sys

import click
import pytest
from click.testing import CliRunner, Result

from reach.cli import main


def reach(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False, terminal_width=80)


def _commands(group: click.Group, path: str = "") -> list[tuple[str, click.Command]]:
    found = []
    for name, command in sorted(group.commands.items()):
        found.append((f"{path}{name}", command))
        if isinstance(command, click.Group):
            found += _commands(command, f"{path}{name} ")
    return found


@pytest.mark.parametrize(("path", "command"), _commands(main))
def test_every_summary_is_one_short_whole_sentence(path: str, command: click.Command) -> None:
    # the width `reach --help` leaves a summary on an 80-column terminal
    summary = command.get_short_help_str(limit=80 - 6 - len("nats-auth"))
    whole = command.short_help or (command.help or "").split("\n\n")[0]
    assert summary == " ".join(whole.split()), path
    assert summary.endswith("."), (path, summary)
    assert not summary.endswith("..."), (path, summary)
    assert summary[0].isupper(), (path, summary)


def test_the_top_level_help_cuts_no_summary() -> None:
    result = reach("--help")
    assert result.exit_code == 0
    commands = result.output.split("Commands:\n", 1)[1].splitlines()
    assert len(commands) == len(main.commands)
    for line in commands:
        assert line.rstrip().endswith("."), line
        assert not line.rstrip().endswith("..."), line


@pytest.mark.parametrize(
    ("args", "unknown", "closest"),
    [
        (["agnets"], "agnets", "agents"),
        (["valdiate", "x.yaml"], "valdiate", "validate"),
        (["audit", "tial"], "tial", "tail"),
        (["creds", "ad", "someone"], "ad", "add"),
    ],
)
def test_an_unknown_command_is_answered_with_the_closest(
    args: list[str], unknown: str, closest: str
) -> None:
    result = reach(*args)
    assert result.exit_code == 2
    assert f"No such command {unknown!r}. Did you mean {closest!r}" in result.output


def test_a_command_like_no_other_gets_no_suggestion() -> None:
    result = reach("xyzzy")
    assert result.exit_code == 2
    assert "No such command 'xyzzy'." in result.output
    assert "Did you mean" not in result.output


@pytest.mark.parametrize(
    ("command", "module", "extra"),
    [("console", "starlette", "console"), ("mcp", "mcp", "gateways"), ("a2a", "a2a", "gateways")],
)
def test_a_command_without_its_extra_says_which_to_install(
    monkeypatch: pytest.MonkeyPatch, command: str, module: str, extra: str
) -> None:
    # as if it were not installed: it and what of it another test imported already
    for name in [module, *(n for n in sys.modules if n.startswith(f"{module}."))]:
        monkeypatch.setitem(sys.modules, name, None)
    result = CliRunner().invoke(main, [command], catch_exceptions=False)
    assert result.exit_code != 0, result.output
    assert f"pip install 'agent-reach[{extra}]'" in result.output
    assert "Traceback" not in result.output
