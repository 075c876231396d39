"""The marker that records which series is applied to a target.

In an installed torch it is ``<dist-info>/TORCH_PATCHES.json`` (listed in
RECORD); in a source tree ``.torch_patches.json`` at the top; in a patched
wheel ``<dist-info>/TORCH_PATCHES.json``. An in-place marker also keeps the
pristine bytes of every touched file and the RECORD undo log, so ``revert``
is exact even after the shipped series has changed.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Dict, Optional

from .patching import Files
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


def build(series: Series, pristine: Files, patched: Files, kind: str,
          keep_pristine: bool = True, mtimes: Optional[Dict[str, int]] = None) -> dict:
    """A marker dict for ``series`` applied to ``pristine`` giving ``patched``."""
    files = {}
    for path in sorted(set(pristine) | set(patched)):
        entry = {"pristine_sha256": _sha(pristine.get(path)),
                 "patched_sha256": _sha(patched.get(path))}
        if keep_pristine:
            entry["pristine"] = _encode(pristine.get(path))
            if mtimes and path in mtimes:
                entry["pristine_mtime_ns"] = mtimes[path]
        files[path] = entry
    return {
        "tool": "torch_patches",
        "format": FORMAT,
        "kind": kind,
        "base": {"version": series.base.version, "git_version": series.base.git_version},
        "version": series.version,
        "series": series.identity(),
        "subjects": {p.name: p.subject for p in series.patches},
        "files": files,
    }


def dumps(marker: dict) -> bytes:
    return (json.dumps(marker, indent=1, sort_keys=True) + "\n").encode("utf-8")


def loads(data: bytes, where: str) -> dict:
    from .errors import TorchPatchesError
    try:
        marker = json.loads(data)
        assert marker.get("tool") == "torch_patches" and "series" in marker
    except (ValueError, AssertionError):
        raise TorchPatchesError(f"{where} is not a valid torch_patches marker; reinstall torch")
    return marker


def pristine_files(marker: dict) -> Files:
    """The pristine contents recorded in an in-place marker."""
    return {p: _decode(e.get("pristine")) for p, e in marker["files"].items()}


def pristine_mtimes(marker: dict) -> Dict[str, int]:
    return {p: e["pristine_mtime_ns"] for p, e in marker["files"].items() if "pristine_mtime_ns" in e}


def changed_since(marker: dict, current: Files) -> list:
    """Paths whose current content is not what the marker says was written."""
    return sorted(p for p, e in marker["files"].items() if _sha(current.get(p)) != e["patched_sha256"])


def same_series(marker: dict, series: Series) -> bool:
    return marker.get("series") == series.identity()


def describe(marker: dict) -> str:
    s = marker["series"]
    names = ", ".join(p["name"] for p in s["patches"]) or "empty series"
    return f"series revision {s['revision']} ({names})"
