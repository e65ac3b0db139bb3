"""Agent-Reach benchmarks: ``python -m bench`` (or ``make bench``).

Speed claims are measured side by side on the same machine in the same run: each stack
against raw nats-py, repetitions interleaved, medians with min–max, ratios to raw.
"""
