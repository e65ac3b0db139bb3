"""``python -m reach``: the ``reach`` command line."""

from reach.cli import main

main()
