"""MkDocs hook: the repository files the documentation links to become part of the site.

The pages link to files outside docs/ as GitHub shows them, relative to the page
(``../schemas/instance.schema.json``, ``../examples/node/README.md``). Each such file is
added to the site under the same path without the ``../`` (``schemas/...``) and the link
rewritten to match, so the links work both on GitHub and on the site. A link to a
repository file that does not exist is left as it is, and ``mkdocs build --strict``
refuses it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
_LINK = re.compile(r"\]\(\.\./((?:[\w.-]+/)*[\w.-]+/?)(#[\w.-]*)?\)")
_ANY_LINK = re.compile(r"\]\(((?:\.\./)*(?:[\w.-]+/)*[\w.-]+\.md)(#[\w.-]*)?\)")
_linked: set[str] = set()


def _target(path: str) -> str | None:
    """The repository file a link names (a directory means its README.md), or None."""
    candidate = ROOT / path
    if candidate.is_dir():
        candidate = candidate / "README.md"
    if not candidate.is_file() or ROOT / "docs" in candidate.parents:
        return None
    return candidate.relative_to(ROOT).as_posix()


def on_files(files: Files, config: Any) -> Files:
    """Add every repository file a page links to (pages are read from disk here)."""
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

    if page.file.src_uri in _linked:
        return _ANY_LINK.sub(lambda m: _from_repo_file(m, page.file.src_uri), markdown)
    return _LINK.sub(rewrite, markdown)


def _from_repo_file(match: re.Match[str], src_uri: str) -> str:
    """In a repository file shown on the site, a link to a page of docs/ points at it."""
    here = posixpath.dirname(src_uri)
    target = posixpath.normpath(posixpath.join(here, match.group(1)))
    if not target.startswith("docs/"):
        return match.group(0)
    relative = posixpath.relpath(target.removeprefix("docs/"), here or ".")
    return f"]({relative}{match.group(2) or ''})"
