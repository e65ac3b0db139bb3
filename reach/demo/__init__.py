"""``reach demo``: the failure Agent-Reach was born from, on an embedded NATS."""

from reach.demo.scenario import run_demo

__all__ = ["run_demo"]
