"""The marker that records which series is applied to a target, as a frozen value.

In an installed torch it is ``<dist-info>/TORCH_PATCHES.json`` (listed in
RECORD); in a source tree ``.torch_patches.json`` at the top; in a patched
wheel ``<dist-info>/TORCH_PATCHES.json``. An in-place marker also keeps the
pristine bytes of every touched file and the RECORD undo log, so ``revert``
is exact even after the shipped series has changed.

:meth:`Marker.build` is the one constructor from a series,
:meth:`Marker.to_bytes` the one writer and :meth:`Marker.from_bytes` the one
reader (the JSON format is unchanged since format 1, so markers written by
earlier versions of the tool still read).
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import Dict, List, Mapping, Optional, Tuple

from .errors import TorchPatchesError
from .files import Files
from .series import Series

MARKER_NAME = "TORCH_PATCHES.json"
SOURCE_MARKER_NAME = ".torch_patches.json"
FORMAT = 1


def _sha(data: Optional[bytes]) -> Optional[str]:
    return None if data is None else hashlib.sha256(data).hexdigest()


def _encode(data: Optional[bytes]):
    if data is None:
        return None
    try:
        return {"text": data.decode("utf-8")}
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(data).decode("ascii")}


def _decode(value) -> Optional[bytes]:
    if value is None:
        return None
    if "text" in value:
        return value["text"].encode("utf-8")
    return base64.b64decode(value["base64"])


@dataclass(frozen=True)
class FileEntry:
    """One touched file: its hashes before/after, and (in place) its pristine copy."""

    pristine_sha256: Optional[str]
    patched_sha256: Optional[str]
    keeps_pristine: bool = False  # in-place markers keep the bytes; wheel markers do not
    pristine: Optional[bytes] = field(default=None, repr=False)  # None with keeps_pristine: absent
    pristine_mtime_ns: Optional[int] = None


@dataclass(frozen=True)
class Marker:
    """Which series (revision and patch hashes) is applied to which base, and how to undo it."""

    kind: str  # "installed", "source" or "wheel"
    base_version: str
    base_git_version: str
    version: str  # the patched build's version, <base>+fsdp.N (a wheel: <base>+cu132.fsdp.N)
    revision: int
    patches: Tuple[Tuple[str, str], ...]  # (name, sha256) in series order
    subjects: Mapping[str, str]
    files: Mapping[str, FileEntry]
    retired: Mapping[str, str] = field(default_factory=dict)  # patch name -> why (already in base)
    record_undo: Mapping[str, list] = field(default_factory=dict)  # installed: Record.update's log
    base_wheel: Optional[str] = None  # wheel: the base wheel's file name

    # -- the one constructor from a series ----------------------------------------
    @classmethod
    def build(cls, series: Series, pristine: Files, patched: Files, kind: str, *, keep_pristine: bool = True,
              mtimes: Optional[Mapping[str, int]] = None, retired: Optional[Mapping[str, str]] = None,
              base_wheel: Optional[str] = None, version: Optional[str] = None) -> "Marker":
        """The marker for ``series`` applied to ``pristine`` giving ``patched`` (``version``:
        the patched build's, default :attr:`Series.version`)."""
        mtimes = mtimes or {}
        files = {path: FileEntry(_sha(pristine.get(path)), _sha(patched.get(path)), keep_pristine,
                                 pristine.get(path) if keep_pristine else None,
                                 mtimes.get(path) if keep_pristine else None)
                 for path in sorted(set(pristine) | set(patched))}
        return cls(kind=kind, base_version=series.base.version, base_git_version=series.base.git_version,
                   version=version or series.version, revision=series.revision,
                   patches=tuple((p.name, p.sha256) for p in series.patches),
                   subjects={p.name: p.subject for p in series.patches}, files=files,
                   retired=dict(retired or {}), base_wheel=base_wheel)

    def with_record_undo(self, undo: Mapping[str, list]) -> "Marker":
        return replace(self, record_undo=dict(undo))

    # -- the one writer and the one reader -----------------------------------------
    def to_bytes(self) -> bytes:
        files = {}
        for path, e in self.files.items():
            entry: Dict[str, object] = {"pristine_sha256": e.pristine_sha256, "patched_sha256": e.patched_sha256}
            if e.keeps_pristine:
                entry["pristine"] = _encode(e.pristine)
                if e.pristine_mtime_ns is not None:
                    entry["pristine_mtime_ns"] = e.pristine_mtime_ns
            files[path] = entry
        data: Dict[str, object] = {
            "tool": "torch_patches", "format": FORMAT, "kind": self.kind,
            "base": {"version": self.base_version, "git_version": self.base_git_version},
            "version": self.version, "series": self.identity(), "subjects": dict(self.subjects), "files": files,
        }
        if self.retired:
            data["retired"] = dict(self.retired)
        if self.record_undo:
            data["record"] = dict(self.record_undo)
        if self.base_wheel is not None:
            data["base_wheel"] = self.base_wheel
        return (json.dumps(data, indent=1, sort_keys=True) + "\n").encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "Marker":
        try:
            raw = json.loads(data)
            if raw.get("tool") != "torch_patches" or "series" not in raw:
                raise ValueError("not a marker")
            series = raw["series"]
            files = {path: FileEntry(e.get("pristine_sha256"), e.get("patched_sha256"), "pristine" in e,
                                     _decode(e.get("pristine")), e.get("pristine_mtime_ns"))
                     for path, e in raw.get("files", {}).items()}
            return cls(kind=raw.get("kind", "?"), base_version=raw.get("base", {}).get("version", "?"),
                       base_git_version=raw.get("base", {}).get("git_version", "?"),
                       version=raw.get("version", "?"), revision=int(series["revision"]),
                       patches=tuple((p["name"], p["sha256"]) for p in series["patches"]),
                       subjects=raw.get("subjects", {}), files=files, retired=raw.get("retired") or {},
                       record_undo=raw.get("record") or {}, base_wheel=raw.get("base_wheel"))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise TorchPatchesError(f"{where} is not a valid torch_patches marker; reinstall torch")

    # -- questions ----------------------------------------------------------------------
    def identity(self) -> dict:
        """Which series: the same shape as :meth:`Series.identity`."""
        return {"revision": self.revision, "patches": [{"name": n, "sha256": s} for n, s in self.patches]}

    def same_series(self, series: Series) -> bool:
        return self.identity() == series.identity()

    def describe(self) -> str:
        """``series revision N, K patches``: how messages name a recorded series (its patch
        names are in ``status``)."""
        n = len(self.patches)
        if not n:
            return f"series revision {self.revision} (empty series)"
        return f"series revision {self.revision}, {n} patch" + ("" if n == 1 else "es")

    def changed_since(self, current: Files) -> List[str]:
        """Paths whose current content is not what the marker says was written."""
        return sorted(p for p, e in self.files.items() if _sha(current.get(p)) != e.patched_sha256)

    def pristine_files(self) -> Files:
        """The pristine contents recorded in an in-place marker."""
        return {p: e.pristine for p, e in self.files.items()}

    def pristine_mtimes(self) -> Dict[str, int]:
        return {p: e.pristine_mtime_ns for p, e in self.files.items() if e.pristine_mtime_ns is not None}
