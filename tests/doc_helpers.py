"""The fenced code blocks of a Markdown page, for the tests that run a page's examples
(tests/test_readme.py, tests/test_testing_docs.py).

A block is tagged with its language and may carry a title (```` ```python
title="agent.py" ````): the file it is, or ``output`` for what a command prints.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_FENCE = re.compile(r'^```(\w*)(?:\s+title="([^"]+)")?\s*$')


@dataclass(frozen=True)
class Block:
    file: str
    line: int
    lang: str
    title: str | None
    code: str
    before: str  # the last line of prose before the block

    def __str__(self) -> str:
        return f"{self.file}:{self.line} ({self.lang}{' ' + self.title if self.title else ''})"


def blocks(path: Path, ports: dict[str, str] | None = None) -> list[Block]:
    """The fenced blocks of ``path``, with the ports it names replaced by ``ports``."""
    text = path.read_text()
    for default, port in (ports or {}).items():
        text = text.replace(default, port)
    name = path.relative_to(ROOT).as_posix()
    found: list[Block] = []
    opened: tuple[int, str, str | None, str] | None = None
    body: list[str] = []
    prose = ""
    for n, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if opened is None and match:
            opened, body = (n, match.group(1), match.group(2), prose), []
        elif opened is not None and line.strip() == "```":
            start, lang, title, before = opened
            found.append(Block(name, start, lang, title, "\n".join(body) + "\n", before))
            opened = None
        elif opened is not None:
            body.append(line)
        elif line.strip():
            prose = line
    assert opened is None, f"{name}:{opened[0]}: unclosed code block"
    return found
