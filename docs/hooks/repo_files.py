"""MkDocs hook: the repository files the documentation links to become part of the site.

The pages link to files outside docs/ as GitHub shows them, relative to the page
(``../schemas/instance.schema.json``, ``../examples/node/README.md``). Each such file is
added to the site under the same path without the ``../`` (``schemas/...``) and the link
rewritten to match, so the links work both on GitHub and on the site. A link to a
repository file that does not exist is left as it is, and ``mkdocs build --strict``
refuses it; so is a link to a file that git ignores and does not track (a result the
benchmarks wrote but nobody added), which a clone would not have.

A line that is only a link to a section of the README (``[…](../README.md#anchor)``) is
replaced by that section, its links to ``docs/`` made relative to the site: the
README's quickstart is the site's, word for word.
"""

from __future__ import annotations

import posixpath
import re
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
_LINK = re.compile(r"\]\(\.\./((?:[\w.-]+/)*[\w.-]+/?)(#[\w.-]*)?\)")
_ANY_LINK = re.compile(r"\[([^\]]*)\]\(((?:\.\./)+(?:[\w.-]+/)*[\w.-]*)(#[\w.-]*)?\)")
_INCLUDE = re.compile(r"^\[[^\]]*\]\(\.\./README\.md#([\w-]+)\)$", re.MULTILINE)
#: the repository files on the site, found anew at each build (``mkdocs serve`` rebuilds)
_linked: set[str] = set()


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    kept = "".join(c for c in heading.strip().lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def _readme_section(anchor: str) -> str:
    """The README's section with that anchor, down to the next heading of its level."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    fence = False
    start: int | None = None
    for n, line in enumerate(lines):
        fence = fence != line.startswith("```")
        if fence or not line.startswith("## "):
            continue
        if start is not None:
            return "\n".join(lines[start:n]).replace("](docs/", "](")
        if _slug(line[3:]) == anchor:
            start = n
    if start is None:
        raise ValueError(f"README.md has no section #{anchor}")
    return "\n".join(lines[start:]).replace("](docs/", "](")


def _target(path: str) -> str | None:
    """The repository file a link names (a directory means its README.md), or None."""
    if path == "README.md":
        return None
    candidate = ROOT / path
    if candidate.is_dir():
        candidate = candidate / "README.md"
    if not candidate.is_file() or ROOT / "docs" in candidate.parents:
        return None
    relative = candidate.relative_to(ROOT).as_posix()
    return None if _ignored(relative) else relative


@cache
def _ignored(path: str) -> bool:
    """Whether git ignores the file and does not track it; False outside a git checkout
    (an unpacked source archive holds only what was tracked)."""
    try:
        done = subprocess.run(
            ["git", "check-ignore", "-q", path], cwd=ROOT, capture_output=True, check=False
        )
    except OSError:
        return False
    return done.returncode == 0


def on_files(files: Files, config: Any) -> Files:
    """Add every repository file a page links to (pages are read from disk here)."""
    _linked.clear()
    _ignored.cache_clear()  # a file added to git since the last build is linked now
    docs = Path(config["docs_dir"])
    for page in docs.glob("*.md"):
        for match in _LINK.finditer(page.read_text(encoding="utf-8")):
            target = _target(match.group(1))
            if target is not None and target not in _linked:
                _linked.add(target)
                files.append(
                    File(
                        target,
                        src_dir=str(ROOT),
                        dest_dir=config["site_dir"],
                        use_directory_urls=config["use_directory_urls"],
                    )
                )
    return files


def on_page_markdown(markdown: str, page: Page, **_: Any) -> str:
    """Point the links to repository files at their copies in the site."""

    def rewrite(match: re.Match[str]) -> str:
        target = _target(match.group(1))
        if target is None:
            return match.group(0)
        return f"]({target}{match.group(2) or ''})"

    markdown = _INCLUDE.sub(lambda m: _readme_section(m.group(1)), markdown)
    if page.file.src_uri in _linked:
        return _ANY_LINK.sub(lambda m: _from_repo_file(m, page.file.src_uri), markdown)
    return _LINK.sub(rewrite, markdown)


def _from_repo_file(match: re.Match[str], src_uri: str) -> str:
    """A link in a repository file shown on the site: to a page of docs/, made relative
    to it; to another repository file on the site, kept; to anything else in the
    repository (a directory of tests), its text alone."""
    text, path, anchor = match.group(1), match.group(2), match.group(3) or ""
    here = posixpath.dirname(src_uri)
    target = posixpath.normpath(posixpath.join(here, path))
    if target.startswith("docs/"):
        relative = posixpath.relpath(target.removeprefix("docs/"), here or ".")
        return f"[{text}]({relative}{anchor})"
    on_site = _target(target)
    if on_site is not None and on_site in _linked:
        return f"[{text}]({posixpath.relpath(on_site, here or '.')}{anchor})"
    return text
