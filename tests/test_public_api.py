"""The public API is what reach/__init__.py exports, and all of it is importable."""

from __future__ import annotations

import reach


def test_all_lists_exactly_the_public_names() -> None:
    public = {name for name in vars(reach) if not name.startswith("_")}
    modules = {name for name in public if type(getattr(reach, name)).__name__ == "module"}
    assert set(reach.__all__) == public - modules
    assert sorted(reach.__all__, key=str.lower) == sorted(set(reach.__all__), key=str.lower)


def test_the_design_entry_points_are_exported() -> None:
    for name in (
        "Agent",
        "ReachClient",
        "Manifest",
        "ReachError",
        "ContractError",
        "Fallback",
        "Fabric",
    ):
        assert hasattr(reach, name)
