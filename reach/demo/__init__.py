"""``reach demo``: the failure Agent-Reach was born from, on a secured embedded fabric."""

from reach.demo.scenario import run_demo

__all__ = ["run_demo"]
