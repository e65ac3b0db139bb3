"""docs/manifest.md stays true: its complete example is a manifest ``reach validate``
accepts and sets every field a manifest may set, and its reference table names every
such field and no other."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from click.testing import CliRunner
from pydantic import BaseModel

from reach.cli import main
from reach.wire.models import Capability, HealthSettings, Manifest

MANIFEST_DOC = Path(__file__).resolve().parent.parent / "docs" / "manifest.md"
_YAML = re.compile(r"^```yaml\n(.*?)^```$", re.S | re.M)
#: a row of the reference table: its first cell, the field's name(s)
_ROW = re.compile(r"^\| (`[^|]*`) \|", re.M)


def _example() -> str:
    blocks = _YAML.findall(MANIFEST_DOC.read_text(encoding="utf-8"))
    assert len(blocks) == 1, f"docs/manifest.md: expected one yaml example, found {len(blocks)}"
    return str(blocks[0])


def _fields(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every field a manifest may set, named as the reference table names them
    (``capabilities[].name``, ``health.interval_sec``)."""
    names: set[str] = set()
    for name in model.model_fields:
        names.add(prefix + name)
        if model is Manifest and name == "capabilities":
            names |= _fields(Capability, "capabilities[].")
        elif model is Manifest and name == "health":
            names |= _fields(HealthSettings, "health.")
    return names


def _set(data: dict[str, Any]) -> set[str]:
    """The fields a manifest's data sets, named as :func:`_fields` names them."""
    names = set(data)
    for cap in data.get("capabilities") or ():
        names |= {f"capabilities[].{name}" for name in cap}
    names |= {f"health.{name}" for name in data.get("health") or {}}
    return names


def _table() -> set[str]:
    """The fields the reference table has a row for; ``a[].b`` / ``c`` names two."""
    names: set[str] = set()
    for cell in _ROW.findall(MANIFEST_DOC.read_text(encoding="utf-8")):
        spans = re.findall(r"`([^`]+)`", cell)
        prefix = spans[0].rpartition(".")[0]
        names.add(spans[0])
        names |= {f"{prefix}.{span}" if prefix else span for span in spans[1:]}
    return names


def test_reach_validate_accepts_the_example(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(_example(), encoding="utf-8")
    result = CliRunner().invoke(main, ["validate", str(path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert result.stdout == "OK: report-gen-001 (1 capability)\n"


def test_the_example_sets_every_field() -> None:
    missing = _fields(Manifest) - _set(yaml.safe_load(_example()))
    assert not missing, f"docs/manifest.md's example leaves out {sorted(missing)}"


def test_the_reference_table_names_every_field_and_no_other() -> None:
    table = _table()
    fields = _fields(Manifest)
    assert not fields - table, f"no row in docs/manifest.md for {sorted(fields - table)}"
    assert not table - fields, f"docs/manifest.md has rows for no field: {sorted(table - fields)}"
