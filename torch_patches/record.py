"""A dist-info ``RECORD`` (PEP 376 / PEP 627): read once, look up in O(1), edit, verify.

The one owner of RECORD for every command: ``apply``/``revert`` edit the
installed RECORD (:meth:`Record.update` / :meth:`Record.undo`), ``wheel``
writes the patched wheel's (:meth:`Record.rewritten`) and ``wheel --verify``
checks it (:meth:`Record.verify`). Edits keep every untouched line byte for
byte (including its ``\\r\\n``), so that :meth:`Record.undo` restores the
original file exactly.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
from typing import Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple


def record_hash(data: bytes) -> str:
    """``sha256=<urlsafe base64, no padding>`` as RECORD writes it."""
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


class Row(NamedTuple):
    path: str
    hash: str
    size: str


def _parse_line(line: str) -> Optional[Row]:
    text = line.rstrip("\r\n")
    if '"' not in text:  # csv quotes any field with a comma: split from the right
        fields = text.rsplit(",", 2) if text else []
        if len(fields) == 3:
            return Row(fields[0], fields[1], fields[2])
    fields = next(csv.reader([text]), [])
    if not fields:
        return None
    fields += [""] * (3 - len(fields))
    return Row(fields[0], fields[1], fields[2])


class Record:
    """A RECORD file: its raw lines, each parsed once, and a path index."""

    def __init__(self, text: str):
        self.lines: List[str] = text.splitlines(keepends=True)
        first = self.lines[0] if self.lines else "\n"
        self.newline = "\r\n" if first.endswith("\r\n") else "\n"
        if self.lines and not self.lines[-1].endswith("\n"):
            self.lines[-1] += self.newline
        self._reindex()

    def _reindex(self) -> None:
        self._parsed = [_parse_line(line) for line in self.lines]
        self._index = {row.path: i for i, row in enumerate(self._parsed) if row is not None}

    def copy(self) -> "Record":
        """An independent copy (no re-parsing)."""
        other = Record.__new__(Record)
        other.lines, other.newline = list(self.lines), self.newline
        other._parsed, other._index = list(self._parsed), dict(self._index)
        return other

    # -- reading -----------------------------------------------------------
    def text(self) -> str:
        return "".join(self.lines)

    def rows(self) -> List[Row]:
        return [row for row in self._parsed if row is not None]

    def __contains__(self, path: str) -> bool:
        return path in self._index

    def get(self, path: str) -> Optional[Tuple[str, str]]:
        """``(hash, size)`` recorded for ``path``, or ``None`` if not listed."""
        i = self._index.get(path)
        if i is None:
            return None
        row = self._parsed[i]
        assert row is not None
        return row.hash, row.size

    def line_for(self, path: str, data: Optional[bytes]) -> str:
        """The RECORD line for ``path`` with content ``data`` (``None``: no hash, as for RECORD itself)."""
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator=self.newline)
        writer.writerow([path, "", ""] if data is None else [path, record_hash(data), str(len(data))])
        return buf.getvalue()

    def verify(self, paths: Iterable[str], read: Callable[[str], Optional[bytes]]) -> List[str]:
        """Problems with the files at ``paths`` (``read(path)``: content, ``None``: absent) against this RECORD."""
        problems = []
        for path in paths:
            data = read(path)
            row = self.get(path)
            if data is None:
                if row is not None and row[0]:
                    problems.append(f"{path}: listed in RECORD but missing")
            elif row is None:
                problems.append(f"{path}: not listed in RECORD")
            elif row[0] != record_hash(data) or (row[1] and int(row[1]) != len(data)):
                problems.append(f"{path}: hash/size does not match RECORD")
        return problems

    # -- editing -------------------------------------------------------------
    def update(self, changes: Mapping[str, Optional[bytes]]) -> Dict[str, list]:
        """Point rows at new contents; ``None`` content removes the row.

        Returns an undo log ``{path: [original_index_or_None, original_line]}``
        for :meth:`undo`. Rows for new paths are appended at the end.
        """
        undo: Dict[str, list] = {}
        removed = []
        for path, data in changes.items():
            i = self._index.get(path)
            undo[path] = [i, self.lines[i] if i is not None else None]
            if i is None:
                if data is not None:
                    self.lines.append(self.line_for(path, data))
            elif data is None:
                removed.append(i)
            else:
                self.lines[i] = self.line_for(path, data)
        for i in sorted(removed, reverse=True):
            del self.lines[i]
        self._reindex()
        return undo

    def undo(self, log: Mapping[str, list]) -> None:
        """Reverse :meth:`update` given its log (byte-exact)."""
        added = {p for p, (i, _) in log.items() if i is None}
        self.lines = [line for line, row in zip(self.lines, self._parsed) if row is None or row.path not in added]
        self._reindex()
        deleted = sorted((i, line) for p, (i, line) in log.items() if i is not None and p not in self._index)
        for i, line in deleted:
            self.lines.insert(i, line)
        self._reindex()
        for path, (i, line) in log.items():
            if i is not None and path in self._index:
                self.lines[self._index[path]] = line
        self._reindex()

    def rewritten(self, rename: Callable[[str], str], content: Mapping[str, Optional[bytes]],
                  record_path: str) -> str:
        """The RECORD of a rewritten archive: rows renamed by ``rename``, rows of
        ``content`` rehashed (``None``: dropped), new ``content`` paths listed just
        before ``record_path`` (which keeps no hash). Other rows are kept verbatim."""
        out: List[str] = []
        listed = set()
        for line, row in zip(self.lines, self._parsed):
            if row is None:
                continue
            path = rename(row.path)
            listed.add(path)
            if path == record_path:
                for extra in sorted(p for p in content if p not in listed and content[p] is not None):
                    out.append(self.line_for(extra, content[extra]))
                    listed.add(extra)
                out.append(self.line_for(path, None))
            elif path in content:
                if content[path] is not None:
                    out.append(self.line_for(path, content[path]))
            elif path != row.path:
                buf = io.StringIO()
                csv.writer(buf, lineterminator=self.newline).writerow([path, row.hash, row.size])
                out.append(buf.getvalue())
            else:
                out.append(line if line.endswith(self.newline) else line.rstrip("\r\n") + self.newline)
        return "".join(out)
