"""Docs entries: insert a tracker's snippets into upstream's docs source file.

A series directory may hold ``docs/<tracker key>.md`` (format:
:func:`torch_patches.series.parse_docs_entries`). ``export --source DIR``
inserts each tracker's entries into the ``[docs] file`` of DIR (as the earlier
PRs of the stack left it) and commits them in that tracker's PR; without
``--source`` the entries are written to the PR directory's ``DOCS.md``.

An anchor is a line of the docs file, compared without surrounding
whitespace; it must occur exactly once. Its block is the fenced block
(```` ```{eval-rst} ... ``` ````) that holds it, else its paragraph (up to the
next blank line that is not followed by an indented line). ``after:``
snippets go after that block, ``before:`` snippets before it, each separated
from its neighbours by one blank line.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ..errors import TorchPatchesError
from ..series import DocsEntry


def _fences(lines: Sequence[str]) -> List[Tuple[int, int]]:
    """``(opening, closing)`` line indices of the fenced blocks (backtick fences)."""
    out, start, width = [], None, 0
    for i, line in enumerate(lines):
        s = line.strip()
        ticks = len(s) - len(s.lstrip("`"))
        if start is None and ticks >= 3:
            start, width = i, ticks
        elif start is not None and ticks >= width and s == "`" * ticks:
            out.append((start, i))
            start = None
    if start is not None:
        out.append((start, len(lines) - 1))
    return out


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def block(lines: Sequence[str], at: int) -> Tuple[int, int]:
    """First and last line index of the block holding line ``at``."""
    for start, end in _fences(lines):
        if start <= at <= end:
            return start, end
    start = at
    while start > 0 and lines[start - 1].strip():
        start -= 1
    end, i, level = at, at + 1, _indent(lines[at])
    while i < len(lines):
        if lines[i].strip():
            if not lines[i - 1].strip() and _indent(lines[i]) <= level:
                break
            end = i
        i += 1
    return start, end


def insert(text: str, entry: DocsEntry, docs_file: str, context: str = "") -> str:
    """``text`` (the docs file) with ``entry``'s snippet at its anchor.

    Raises :class:`TorchPatchesError` naming ``docs_file`` and the anchor if
    the anchor line is missing or not unique.
    """
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    hits = [i for i, line in enumerate(lines) if line.strip() == entry.anchor]
    if not hits:
        raise TorchPatchesError(
            f"docs entry {entry.source}: anchor `{entry.anchor}` (its `{entry.where}:` line) not found in "
            f"{docs_file}{context}; point the entry at a line of that file")
    if len(hits) > 1:
        raise TorchPatchesError(
            f"docs entry {entry.source}: anchor `{entry.anchor}` (its `{entry.where}:` line) occurs "
            f"{len(hits)} times in {docs_file}{context} (lines {', '.join(str(i + 1) for i in hits)}); "
            "point the entry at a line that occurs once")
    start, end = block(lines, hits[0])
    snippet = entry.snippet.splitlines(keepends=True)
    if entry.where == "after":
        at = end + 1
        before_blank = True
        after_blank = at < len(lines) and bool(lines[at].strip())
    else:
        at = start
        before_blank = at > 0 and bool(lines[at - 1].strip())
        after_blank = True
    new = (["\n"] if before_blank else []) + snippet + (["\n"] if after_blank else [])
    return "".join(lines[:at] + new + lines[at:])


def insert_all(text: str, entries: Sequence[DocsEntry], docs_file: str, context: str = "") -> str:
    """``text`` with every entry inserted, in order."""
    for entry in entries:
        text = insert(text, entry, docs_file, context)
    return text


def describe(entry: DocsEntry) -> str:
    """Where an entry goes, for messages: ``after the block of `LINE```."""
    return f"{entry.where} the block of `{entry.anchor}`"


def docs_markdown(ref: str, entries: Sequence[DocsEntry], docs_file: str, why: Optional[str]) -> str:
    """``DOCS.md`` of a PR directory: the entries and where they go (not committed: ``why``)."""
    lines = [f"# Docs entries for {ref}", ""]
    if why:
        lines += [why, ""]
    for entry in entries:
        lines += [f"## Into `{docs_file}`, {describe(entry)}", "", "````markdown", entry.snippet.rstrip("\n"),
                  "````", ""]
    return "\n".join(lines).rstrip() + "\n"
