"""Read, edit and verify a dist-info ``RECORD`` (PEP 376 / PEP 627).

Edits keep every untouched line byte for byte (including its ``\\r\\n``), so
that :func:`Record.undo` can restore the original file exactly.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
from typing import Dict, List, Optional, Tuple


def record_hash(data: bytes) -> str:
    """``sha256=<urlsafe base64, no padding>`` as RECORD writes it."""
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def _parse_line(line: str) -> List[str]:
    rows = list(csv.reader([line.rstrip("\r\n")]))
    return rows[0] if rows else []


class Record:
    """A RECORD file as a list of raw lines with a path index."""

    def __init__(self, text: str):
        self.lines: List[str] = text.splitlines(keepends=True)
        first = self.lines[0] if self.lines else "\n"
        self.newline = "\r\n" if first.endswith("\r\n") else "\n"
        if self.lines and not self.lines[-1].endswith("\n"):
            self.lines[-1] += self.newline

    # -- reading -----------------------------------------------------------
    def text(self) -> str:
        return "".join(self.lines)

    def rows(self) -> List[Tuple[str, str, str]]:
        out = []
        for line in self.lines:
            fields = _parse_line(line)
            if fields:
                fields += [""] * (3 - len(fields))
                out.append((fields[0], fields[1], fields[2]))
        return out

    def _index(self) -> Dict[str, int]:
        return {(_parse_line(line) or [""])[0]: i for i, line in enumerate(self.lines)}

    def get(self, path: str) -> Optional[Tuple[str, str]]:
        """``(hash, size)`` recorded for ``path``, or ``None`` if not listed."""
        i = self._index().get(path)
        if i is None:
            return None
        fields = _parse_line(self.lines[i]) + ["", ""]
        return fields[1], fields[2]

    def line_for(self, path: str, data: Optional[bytes]) -> str:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator=self.newline)
        if data is None:
            writer.writerow([path, "", ""])
        else:
            writer.writerow([path, record_hash(data), str(len(data))])
        return buf.getvalue()

    # -- editing -------------------------------------------------------------
    def update(self, changes: Dict[str, Optional[bytes]]) -> Dict[str, list]:
        """Point rows at new contents; ``None`` content removes the row.

        Returns an undo log ``{path: [original_index_or_None, original_line]}``
        for :meth:`undo`. Rows for new paths are appended at the end.
        """
        index = self._index()
        undo: Dict[str, list] = {}
        removed = []
        for path, data in changes.items():
            i = index.get(path)
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
        return undo

    def undo(self, log: Dict[str, list]) -> None:
        """Reverse :meth:`update` given its log (byte-exact)."""
        added = {p for p, (i, _) in log.items() if i is None}
        self.lines = [l for l in self.lines if (_parse_line(l) or [""])[0] not in added]
        index = self._index()
        deleted = sorted((i, line) for p, (i, line) in log.items() if i is not None and p not in index)
        for i, line in deleted:
            self.lines.insert(i, line)
        index = self._index()
        for path, (i, line) in log.items():
            if i is not None and path in index:
                self.lines[index[path]] = line


def verify_rows(rows, read) -> List[str]:
    """Check ``rows`` against ``read(path) -> bytes | None``; list the problems."""
    problems = []
    for path, hash_, size in rows:
        if not hash_:
            continue
        data = read(path)
        if data is None:
            problems.append(f"{path}: listed in RECORD but missing")
        elif record_hash(data) != hash_:
            problems.append(f"{path}: hash does not match RECORD")
        elif size and int(size) != len(data):
            problems.append(f"{path}: size does not match RECORD")
    return problems
