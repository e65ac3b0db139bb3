"""The public API is what reach/__init__.py exports, and all of it is importable."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import reach


def test_all_lists_exactly_the_public_names() -> None:
    public = {name for name in dir(reach) if not name.startswith("_")}
    modules = {name for name in public if type(getattr(reach, name)).__name__ == "module"}
    assert set(reach.__all__) == public - modules
    assert sorted(reach.__all__, key=str.lower) == sorted(set(reach.__all__), key=str.lower)


def test_the_design_entry_points_are_exported() -> None:
    for name in ("Agent", "ReachClient", "CallResult", "Manifest", "Fallback", "current_call"):
        assert hasattr(reach, name)
    # the errors in their module, the operators' names in theirs
    for module, name in (
        ("reach.errors", "ReachError"),
        ("reach.errors", "ContractError"),
        ("reach.fabric", "Fabric"),
        ("reach.registry", "Registrar"),
        ("reach.audit", "read_events"),
    ):
        assert hasattr(importlib.import_module(module), name)
        assert not hasattr(reach, name), f"{name} is an operator's or an error: {module}"


def test_the_public_api_fits_on_one_screen() -> None:
    """What an agent author writes, no more: operator names live in their packages."""
    assert len(reach.__all__) <= 16, reach.__all__


def test_every_public_name_is_the_object_of_the_module_it_comes_from() -> None:
    subpackages = ("agent", "audit", "caller", "registry", "security")
    packages = [reach] + [importlib.import_module(f"reach.{sub}") for sub in subpackages]
    for package in packages:
        exports: dict[str, str] = vars(package)["_EXPORTS"]
        assert set(exports) == set(package.__all__), package.__name__
        for name, module in exports.items():
            assert getattr(package, name) is getattr(importlib.import_module(module), name), (
                f"{package.__name__}.{name} is not {module}.{name}"
            )
    namespace: dict[str, object] = {}
    exec("from reach import *", namespace)
    assert set(reach.__all__) <= set(namespace)


def test_an_unknown_name_is_an_attribute_error_naming_it() -> None:
    with pytest.raises(AttributeError, match="Agnet"):
        reach.Agnet  # type: ignore[attr-defined]  # noqa: B018


def _loaded_by(statement: str) -> list[str]:
    """The modules a fresh interpreter has loaded after ``statement``."""
    root = str(Path(reach.__file__).resolve().parent.parent)  # this reach/, either build
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    loaded: list[str] = json.loads(out.stdout)
    return loaded


def test_import_reach_loads_nothing_else_of_reach_and_no_heavy_dependency() -> None:
    loaded = _loaded_by("import reach")
    # reach.lazy: what imports the public names on first use
    assert sorted(name for name in loaded if name.split(".")[0] == "reach") == [
        "reach",
        "reach.lazy",
    ]
    for heavy in ("nats", "opentelemetry", "tenacity", "jsonschema", "jsonschema_rs", "pydantic"):
        assert not [name for name in loaded if name.split(".")[0] == heavy], (
            f"import reach loads {heavy}"
        )


def test_a_client_process_does_not_load_the_registrar_or_the_alert_rules() -> None:
    loaded = _loaded_by("from reach import ReachClient")
    assert "reach.caller.client" in loaded
    for unneeded in ("reach.registry.registrar", "reach.audit.alert_watcher", "reach.audit.reader"):
        assert unneeded not in loaded
