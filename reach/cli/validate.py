"""``reach validate FILE`` and ``reach schema export DIR``: offline checks of the contract."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NoReturn

import click

from reach.cli.common import Target, connection_options, fail
from reach.errors import ConfigurationError

__all__ = ["load_yaml", "register"]


def _die(message: str) -> NoReturn:
    fail(message)  # exits with code 1
    raise AssertionError("unreachable")


def load_yaml(path: Path) -> Any:
    """Read and parse a YAML file; a missing file or bad syntax exits with a one-line reason."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        _die(f"{path}: no such file")
    except IsADirectoryError:
        _die(f"{path}: is a directory, not a manifest file")
    except UnicodeDecodeError:
        _die(f"{path}: not UTF-8 text")
    except OSError as exc:
        _die(f"{path}: cannot read: {exc.strerror or exc}")
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = exc.problem or exc.context or "invalid YAML"
        _die(f"{path}{where}: YAML syntax error: {problem}")
    except yaml.YAMLError as exc:
        _die(f"{path}: YAML syntax error: {' '.join(str(exc).split())}")


def _count(n: int, singular: str, plural: str) -> str:
    return f"{n} {singular if n == 1 else plural}"


def register(main: click.Group) -> None:
    @main.command("validate", short_help="Check a manifest file and list its problems.")
    @click.argument("file", type=click.Path(path_type=Path))
    @connection_options
    def validate(file: Path, target: Target) -> None:
        """Check a manifest YAML FILE; print every problem with its path.

        Exits 0 and prints "OK: <agent_id> (<n> capabilities)" for a valid manifest (for
        one without agent_id, the rule by which each start draws it), else prints one
        "path: problem" line per error and exits 1.
        """
        from reach.wire.models import parse_manifest

        data = load_yaml(file)
        if data is None:
            _die(f"{file}: empty file, expected a manifest")
        if not isinstance(data, dict):
            _die(f"{file}: a manifest is a YAML mapping, got a {type(data).__name__}")
        try:
            manifest = parse_manifest(data, source=str(file))
        except ConfigurationError as exc:
            for line in exc.errors:
                click.echo(line)
            _die(f"{file}: invalid manifest, {_count(len(exc.errors), 'problem', 'problems')}")
        count = _count(len(manifest.capabilities), "capability", "capabilities")
        if data.get("agent_id"):
            click.echo(f"OK: {manifest.agent_id} ({count})")
        else:
            # the id each start draws, not one drawn now: it would not be the agent's
            click.echo(
                f"OK: {manifest.agent_name}-<8 random hex digits> ({count}); each start of"
                " the agent draws a new agent_id (set agent_id to keep one)"
            )

    @main.group("schema", short_help="Export the wire models' JSON Schemas.")
    def schema() -> None:
        """JSON Schema files for the wire models (for agents in other languages)."""

    @schema.command("export", short_help="Write one JSON Schema file per wire model.")
    @click.argument("directory", metavar="DIR", type=click.Path(file_okay=False, path_type=Path))
    @connection_options
    def export(directory: Path, target: Target) -> None:
        """Write one <model>.schema.json file per wire model into DIR (created if needed)."""
        from reach.wire.schemas import export_schemas

        try:
            paths = export_schemas(directory)
        except OSError as exc:
            _die(f"{directory}: cannot write schemas: {exc.strerror or exc}")
        for path in paths:
            click.echo(str(path))
        click.echo(f"wrote {len(paths)} schemas to {directory}", err=True)
