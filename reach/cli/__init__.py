"""The ``reach`` command line. Each subcommand lives in its own module."""

from __future__ import annotations

from reach.cli.main import main

__all__ = ["main"]
