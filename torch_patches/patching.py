"""A small, strict unified-diff parser and applier (pure Python, bytes in/out).

Rules, chosen so that "applies" means "the target is exactly what the patch
was written against":

* a hunk's context and removed lines must match exactly (no fuzz);
* a hunk may be found at a line offset from its recorded position (the nearest
  match wins), but hunks stay in order and never overlap;
* ``--- /dev/null`` creates a file (it must not exist); ``+++ /dev/null``
  deletes one (its content must match the patch exactly);
* ``\\ No newline at end of file`` is honoured, so results are byte-exact.

Everything happens in memory on a ``{path: bytes | None}`` mapping; writing to
disk is someone else's job (see :mod:`torch_patches.fsutil`).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import List, Optional

from .errors import PatchApplyError, PatchFormatError
from .files import Files


_HUNK_RE = re.compile(rb"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_INDEX_RE = re.compile(rb"^index ([0-9a-f]+)\.\.([0-9a-f]+)")


@dataclass
class Hunk:
    """One ``@@`` block: the lines it expects (``old``) and produces (``new``)."""

    old_start: int
    new_start: int
    old: List[bytes] = field(default_factory=list)
    new: List[bytes] = field(default_factory=list)
    header: str = ""

    def reversed(self) -> "Hunk":
        return Hunk(self.new_start, self.old_start, list(self.new), list(self.old), self.header)


@dataclass
class FilePatch:
    """The changes a patch makes to one file (repo-relative ``path``)."""

    path: str
    hunks: List[Hunk] = field(default_factory=list)
    creates: bool = False
    deletes: bool = False
    old_blob: str = ""  # git blob id prefix of the pre-image ("index" line)
    new_blob: str = ""

    def reversed(self) -> "FilePatch":
        return FilePatch(
            self.path,
            [h.reversed() for h in self.hunks],
            creates=self.deletes,
            deletes=self.creates,
            old_blob=self.new_blob,
            new_blob=self.old_blob,
        )


def _strip_prefix(name: bytes, where: str) -> Optional[str]:
    name = name.split(b"\t", 1)[0].rstrip(b"\r\n")
    if name == b"/dev/null":
        return None
    text = name.decode("utf-8")
    if text.startswith(('"')):
        raise PatchFormatError(f"{where}: quoted file names are not supported: {text}")
    if text[:2] in ("a/", "b/"):
        text = text[2:]
    if text.startswith("/") or ".." in text.split("/"):
        raise PatchFormatError(f"{where}: refusing path outside the tree: {text}")
    return text


def parse_diff(data: bytes, where: str = "patch") -> List[FilePatch]:
    """Parse the unified diffs in ``data`` (``git format-patch`` or plain).

    Raises :class:`PatchFormatError` with ``where`` and a line number when the
    diff is malformed (truncated hunk, garbage inside a hunk, binary patch).
    """
    lines = data.splitlines(keepends=True)
    patches: List[FilePatch] = []
    i = 0
    pending_index = (b"", b"")
    while i < len(lines):
        line = lines[i]
        if line.startswith(b"diff --git "):
            pending_index = (b"", b"")
        elif line.startswith(b"GIT binary patch") or line.startswith(b"Binary files "):
            raise PatchFormatError(f"{where}:{i + 1}: binary patches are not supported")
        m = _INDEX_RE.match(line)
        if m:
            pending_index = (m.group(1), m.group(2))
        if line.startswith(b"--- ") and i + 1 < len(lines) and lines[i + 1].startswith(b"+++ "):
            old_name = _strip_prefix(line[4:], f"{where}:{i + 1}")
            new_name = _strip_prefix(lines[i + 1][4:], f"{where}:{i + 2}")
            if old_name is None and new_name is None:
                raise PatchFormatError(f"{where}:{i + 1}: both sides are /dev/null")
            if old_name and new_name and old_name != new_name:
                raise PatchFormatError(
                    f"{where}:{i + 1}: renames are not supported ({old_name} -> {new_name}); "
                    "export with --no-renames")
            fp = FilePatch(
                path=new_name or old_name,  # type: ignore[arg-type]
                creates=old_name is None,
                deletes=new_name is None,
                old_blob=pending_index[0].decode(),
                new_blob=pending_index[1].decode(),
            )
            pending_index = (b"", b"")
            i += 2
            while i < len(lines) and lines[i].startswith(b"@@"):
                i = _parse_hunk(lines, i, fp, where)
            if not fp.hunks and not (fp.creates or fp.deletes):
                raise PatchFormatError(f"{where}:{i + 1}: no hunks for {fp.path}")
            patches.append(fp)
            continue
        i += 1
    return patches


def _parse_hunk(lines: List[bytes], i: int, fp: FilePatch, where: str) -> int:
    m = _HUNK_RE.match(lines[i])
    if not m:
        raise PatchFormatError(f"{where}:{i + 1}: malformed hunk header: {lines[i]!r}")
    old_start, new_start = int(m.group(1)), int(m.group(3))
    old_len = 1 if m.group(2) is None else int(m.group(2))
    new_len = 1 if m.group(4) is None else int(m.group(4))
    hunk = Hunk(old_start, new_start, header=lines[i].decode("utf-8", "replace").strip())
    i += 1
    old_left, new_left = old_len, new_len
    last = None  # which side(s) the previous line went to, for "\ No newline"
    while old_left > 0 or new_left > 0:
        if i >= len(lines):
            raise PatchFormatError(f"{where}: hunk '{hunk.header}' for {fp.path} is truncated")
        line = lines[i]
        tag, body = line[:1], line[1:]
        if line in (b"\n", b"\r\n"):  # some tools drop the space of empty context lines
            tag, body = b" ", line
        if tag == b" " and old_left > 0 and new_left > 0:
            hunk.old.append(body)
            hunk.new.append(body)
            old_left, new_left, last = old_left - 1, new_left - 1, "both"
        elif tag == b"-" and old_left > 0:
            hunk.old.append(body)
            old_left, last = old_left - 1, "old"
        elif tag == b"+" and new_left > 0:
            hunk.new.append(body)
            new_left, last = new_left - 1, "new"
        elif tag == b"\\":
            _strip_newline(hunk, last)
        else:
            raise PatchFormatError(
                f"{where}:{i + 1}: unexpected line in hunk '{hunk.header}' for {fp.path} "
                f"(line counts do not match the hunk header): {line[:60]!r}")
        i += 1
    if i < len(lines) and lines[i].startswith(b"\\"):
        _strip_newline(hunk, last)
        i += 1
    fp.hunks.append(hunk)
    return i


def _strip_newline(hunk: Hunk, last: Optional[str]) -> None:
    """Honour ``\\ No newline at end of file`` for the line just read."""

    def strip(seq: List[bytes]) -> None:
        if seq and seq[-1].endswith(b"\n"):
            seq[-1] = seq[-1][:-1]

    if last in ("old", "both"):
        strip(hunk.old)
    if last in ("new", "both"):
        strip(hunk.new)


def _find(lines: List[bytes], needle: List[bytes], expected: int, lowest: int) -> int:
    """Index of ``needle`` in ``lines`` nearest to ``expected`` and >= ``lowest``."""
    n, top = len(needle), len(lines) - len(needle)
    if top < lowest:
        return -1
    expected = min(max(expected, lowest), top)
    for delta in range(0, max(expected - lowest, top - expected) + 1):
        for pos in (expected - delta, expected + delta) if delta else (expected,):
            if lowest <= pos <= top and lines[pos:pos + n] == needle:
                return pos
    return -1


def apply_file_patch(content: Optional[bytes], fp: FilePatch, where: str = "patch") -> Optional[bytes]:
    """Apply one file's hunks to ``content`` (``None``: file absent).

    Returns the new content (``None``: file deleted). Raises
    :class:`PatchApplyError` naming the hunk that does not match.
    """
    if fp.creates:
        if content is not None:
            raise PatchApplyError(f"{where}: {fp.path} already exists but the patch creates it")
        content = b""
    elif content is None:
        raise PatchApplyError(f"{where}: {fp.path} does not exist")
    lines = content.splitlines(keepends=True)
    out: List[bytes] = []
    cursor = 0  # lines[:cursor] already consumed
    shift = 0  # offset found for previous hunks
    for hunk in fp.hunks:
        expected = (hunk.old_start - 1 if hunk.old else hunk.old_start) + shift
        pos = _find(lines, hunk.old, expected, cursor)
        if pos < 0:
            raise PatchApplyError(
                f"{where}: hunk '{hunk.header}' does not apply to {fp.path} "
                "(its context or removed lines differ from the file)")
        shift = pos - (hunk.old_start - 1 if hunk.old else hunk.old_start)
        out.extend(lines[cursor:pos])
        out.extend(hunk.new)
        cursor = pos + len(hunk.old)
    out.extend(lines[cursor:])
    result = b"".join(out)
    if fp.deletes:
        if result:
            raise PatchApplyError(f"{where}: {fp.path} has content the deleting patch does not expect")
        return None
    return result


def locate_hunks(content: Optional[bytes], fp: FilePatch) -> List[Optional[int]]:
    """Where each hunk of ``fp`` would apply to ``content``, as a line offset.

    The same search as :func:`apply_file_patch` (in order, exact, nearest
    match), but it does not stop at the first failure: each entry is the
    offset from the hunk's recorded position (``0``: exactly there) or
    ``None`` when the hunk does not match (a conflict). Used to report *where*
    a patch conflicts or moved; it never changes what applies.
    """
    if fp.creates:
        return [0 if content is None else None for _ in fp.hunks] or [0 if content is None else None]
    if content is None:
        return [None for _ in fp.hunks] or [None]
    lines = content.splitlines(keepends=True)
    out: List[Optional[int]] = []
    cursor, shift = 0, 0
    for hunk in fp.hunks:
        recorded = hunk.old_start - 1 if hunk.old else hunk.old_start
        pos = _find(lines, hunk.old, recorded + shift, cursor)
        if pos < 0:
            out.append(None)
            continue
        shift = pos - recorded
        out.append(shift)
        cursor = pos + len(hunk.old)
    return out


def apply_patches(files: Files, file_patches: List[FilePatch], where: str = "patch",
                  reverse: bool = False) -> Files:
    """Apply ``file_patches`` to a copy of ``files``; all or nothing (raises)."""
    result = dict(files)
    seq = [fp.reversed() for fp in reversed(file_patches)] if reverse else file_patches
    for fp in seq:
        result[fp.path] = apply_file_patch(result.get(fp.path), fp, where)
    return result


def git_blob_id(content: bytes) -> str:
    """The git blob id (SHA-1) of ``content``, as in ``index`` lines."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
