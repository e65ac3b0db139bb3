"""Build: the call path compiled to C with mypyc, when asked.

``REACH_COMPILE=1 python setup.py build_ext --inplace`` (what ``make`` runs) compiles the
modules below next to their sources; a plain ``pip install`` builds pure Python, which
behaves the same and is slower on the call path (docs/development.md, "Compiled call path"). All
other metadata lives in pyproject.toml.
"""

from __future__ import annotations

import os
from typing import Any

from setuptools import setup

#: what every call passes through on the caller and the callee, and what they import for
#: it; what the console does with every audit batch; what a registrar does with every
#: heartbeat and probe. Not here: modules with async generators (mypyc does not compile
#: them yet) or an await inside an except block; the registrar's sweep, whose loop reads
#: tuples of records out of dicts (compiled code checks every element of each such tuple
#: and runs slower than the interpreter there), and its heartbeat feed, which tests extend
#: by subclassing (a compiled class cannot be); the CLI, the demo and the test helpers,
#: where speed does not matter.
COMPILED = [
    "reach/agent/admission.py",
    "reach/agent/agent.py",
    "reach/audit/batch.py",
    "reach/audit/columns.py",
    "reach/audit/decode.py",
    "reach/audit/events.py",
    "reach/audit/recording.py",
    "reach/audit/split.py",
    "reach/audit/writer.py",
    "reach/caller/attempt.py",
    "reach/resilience/fallbackcall.py",
    "reach/caller/plan.py",
    "reach/caller/result.py",
    "reach/resilience/retry.py",
    "reach/caller/callstate.py",
    "reach/caller/client.py",
    "reach/wire/codec.py",
    "reach/console/rollup.py",
    "reach/agent/context.py",
    "reach/wire/contract.py",
    "reach/deadline.py",
    "reach/agent/endpoint.py",
    "reach/wire/envelope.py",
    "reach/caller/peers.py",
    "reach/wire/plain.py",
    "reach/registry/controlbudget.py",
    "reach/registry/health.py",
    "reach/registry/material.py",
    "reach/registry/message_auth.py",
    "reach/registry/probes.py",
    "reach/caller/routecache.py",
    "reach/agent/replycache.py",
    "reach/resilience/_window.py",
    "reach/resilience/breaker.py",
    "reach/resilience/outliers.py",
    "reach/resilience/retrybudget.py",
    "reach/caller/routing.py",
    "reach/security/ratelimit.py",
    "reach/agent/serving.py",
    "reach/telemetry.py",
    "reach/transport/mux.py",
    "reach/transport/natsio.py",
    "reach/transport/protocol.py",
    "reach/transport/replies.py",
]


def _extensions() -> list[Any]:
    if os.environ.get("REACH_COMPILE") != "1":
        return []
    from mypyc.build import mypycify  # only needed here: the build's own dependency

    print(f"mypyc: type-checking and generating C for {len(COMPILED)} modules", flush=True)
    # one shared library inside the package (reach/_native__mypyc…so), not at top level,
    # its C split into a file per module so that `build_ext --parallel` compiles them at
    # once (mypyc writes the group's headers under build/reach/ and includes them by
    # bare name)
    extensions = list(
        mypycify(COMPILED, opt_level="3", group_name="reach._native", multi_file=True)
    )
    for extension in extensions:
        extension.include_dirs.append(os.path.join("build", "reach"))
    print("mypyc: compiling the C (one gcc per module, in parallel)", flush=True)
    return extensions


setup(ext_modules=_extensions())
