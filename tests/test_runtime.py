"""Process-wide settings: the garbage collector of a process that follows a registry."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from reach import tune_gc
from reach.runtime import REGISTRY_GC_THRESHOLD


@pytest.fixture
def thresholds() -> Iterator[None]:
    saved = gc.get_threshold()
    try:
        yield
    finally:
        gc.set_threshold(*saved)


@pytest.mark.usefixtures("thresholds")
def test_full_collections_become_rare_and_younger_ones_stay_as_they_were() -> None:
    gc.set_threshold(700, 10, 10)  # Python's defaults
    tune_gc()
    assert gc.get_threshold() == (700, 10, REGISTRY_GC_THRESHOLD)


@pytest.mark.usefixtures("thresholds")
def test_a_higher_threshold_set_by_the_application_is_kept() -> None:
    gc.set_threshold(5000, 20, 50_000)
    tune_gc()
    assert gc.get_threshold() == (5000, 20, 50_000)


@pytest.mark.usefixtures("thresholds")
def test_cycles_are_still_collected_by_the_young_generation() -> None:
    tune_gc()

    class Node:
        other: object = None

    a, b = Node(), Node()
    a.other, b.other = b, a
    alive = weakref.ref(a)
    del a, b
    gc.collect(0)  # the youngest generation only: no full collection needed
    assert alive() is None
