"""Fault injection: issue 24's table of infrastructure and instance faults, as scenarios.

One engine (:mod:`bench.faults.engine`) runs each scenario with real processes (the
fabric, three instances, an open-loop caller) and checks the outcome; ``tests/faults``
runs every scenario for a few seconds, ``python -m bench.faults`` at 200 calls/s for
30–60 s and writes the table. See docs/reliability.md.
"""

from bench.faults.bed import BENCH, QUICK, TESTS, Timing
from bench.faults.engine import report, run_scenario
from bench.faults.scenarios import SCENARIOS

__all__ = ["BENCH", "QUICK", "SCENARIOS", "TESTS", "Timing", "report", "run_scenario"]
