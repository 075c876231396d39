"""The torch installed for an interpreter, found without importing torch.

``locate(PY)`` runs ``PY`` in a subprocess with a tiny script that asks
``importlib`` where the ``torch`` package lives; this process never imports
torch, so the CLI runs from any Python 3.10+.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from ..base import Base, public_version
from ..distinfo import metadata_headers, read_version_py
from ..errors import TorchPatchesError
from ..files import Files
from ..fsutil import resolve_python
from ..marker import MARKER_NAME, Marker
from ..record import Record
from . import Target

_LOCATE = r"""
import importlib.util, json, os, sys
sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]
spec = importlib.util.find_spec("torch")
origin = spec.origin if spec and spec.origin else None
if origin is None and spec and spec.submodule_search_locations:
    origin = os.path.join(list(spec.submodule_search_locations)[0], "__init__.py")
print(json.dumps({"executable": sys.executable, "python": sys.version.split()[0],
                  "torch_init": origin}))
"""


def run_locate(python: str) -> dict:
    """Ask interpreter ``python`` where its torch is (no import of torch)."""
    python = resolve_python(python)
    try:
        proc = subprocess.run([python, "-c", _LOCATE], capture_output=True, text=True,
                              cwd=tempfile.gettempdir(), timeout=120)
    except FileNotFoundError:
        raise TorchPatchesError(f"no such interpreter: {python}")
    except PermissionError:
        raise TorchPatchesError(f"{python} is not executable; pass an interpreter (e.g. VENV/bin/python)")
    if proc.returncode != 0:
        raise TorchPatchesError(f"could not run {python}: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _metadata(path: Path) -> Dict[str, str]:
    try:
        return metadata_headers(path.read_bytes())
    except OSError:
        return {}


class InstalledTorch(Target):
    """The torch in one site-packages directory, with its dist-info."""

    def __init__(self, python: str, info: dict):
        self.python = python
        self.executable = info["executable"]
        self.python_version = info["python"]
        if not info.get("torch_init"):
            raise TorchPatchesError(
                f"{python} has no torch installed; install the torch release the series is pinned to first")
        self.torch_dir = Path(info["torch_init"]).parent
        self.root = self.torch_dir.parent
        found = {}
        for d in sorted(self.root.glob("torch-*.dist-info")):
            meta = _metadata(d / "METADATA")
            if meta.get("name", "").lower() == "torch":
                found[d] = meta
        if len(found) > 1:
            raise TorchPatchesError(
                f"{self.root} holds several torch dist-info directories "
                f"({', '.join(d.name for d in found)}); reinstall torch")
        self.dist_info = next(iter(found), None)
        self.dist_version = found[self.dist_info].get("version", "") if self.dist_info else ""
        self.version_py = read_version_py(self.read("torch/version.py") or b"")
        self._record: Optional[Record] = None
        # A torch installed from our patched wheel carries the wheel's marker.
        marker = self.load_marker()
        self.kind = "wheel" if marker is not None and marker.kind == "wheel" else "installed"

    # -- identity --------------------------------------------------------------
    @property
    def torch_version(self) -> str:
        return str(self.version_py.get("__version__", "?"))

    @property
    def git_version(self) -> str:
        return str(self.version_py.get("git_version", "?"))

    def describe(self) -> List[str]:
        lines = [f"python:  {self.executable} ({self.python_version})",
                 f"torch:   {self.torch_version} at {self.torch_dir}",
                 f"commit:  {self.git_version}"]
        if self.dist_info:
            lines.append(f"dist:    {self.dist_info.name}")
        return lines

    @property
    def base_version(self) -> str:
        return public_version(self.dist_version)

    def base_problem(self, base: Base, action: str = "apply") -> Optional[str]:
        if self.dist_info is None:
            return (f"torch at {self.torch_dir} has no torch-*.dist-info next to it "
                    f"(a source/develop install?); use `{action} --source DIR` for source trees")
        if self.git_version != base.git_version or public_version(self.dist_version) != base.version \
                or public_version(self.torch_version) != base.version:
            found = (f"torch {self.torch_version} (dist {self.dist_version}, commit {self.git_version[:12]}) "
                     f"is not the pinned base torch {base.short}")
            if action == "revert":
                # apply refuses any other torch, and installing one replaced the patched files
                return (f"{found}, so it holds nothing of this series to revert (pip replaced the "
                        f"patched files when it installed this torch)")
            return f"{found}; install it with `pip install torch=={base.version}` and try again"
        return None

    # -- marker / RECORD ---------------------------------------------------------
    @property
    def marker_rel(self) -> Optional[str]:
        return f"{self.dist_info.name}/{MARKER_NAME}" if self.dist_info is not None else None

    @property
    def record_rel(self) -> str:
        assert self.dist_info is not None
        return f"{self.dist_info.name}/RECORD"

    def record(self) -> Record:
        """RECORD as pip left it before any in-place apply (read and parsed once per target)."""
        if self._record is None:
            data = self.read(self.record_rel)
            if data is None:
                raise TorchPatchesError(f"{self.root / self.record_rel} is missing; reinstall torch")
            rec = Record(data.decode("utf-8"))
            old = self.load_marker()
            if old is not None and old.kind == "installed":
                rec.undo(old.record_undo)
                rec.update({self.marker_rel: None})
            self._record = rec
        return self._record

    def verify_pristine(self, pristine: Files) -> List[str]:
        return [f"{problem} (modified after install?)" for problem in self.record().verify(pristine, pristine.get)]

    def is_unmodified(self, files: Files) -> bool:
        # The RECORD pip wrote (before any in-place apply) vouches for them.
        return self.dist_info is not None and not self.verify_pristine(files)

    def bookkeeping(self, pristine: Files, new: Optional[Files], marker: Optional[Marker]) -> Files:
        """The marker and RECORD: RECORD lists the patched files' hashes and the marker."""
        rec = self.record().copy()
        changes = super().bookkeeping(pristine, new, marker)
        if new is not None:
            assert marker is not None and self.marker_rel is not None
            undo = rec.update({p: new[p] for p in new if new[p] != pristine.get(p)})
            data = marker.with_record_undo(undo).to_bytes()
            rec.update({self.marker_rel: data})
            changes[self.marker_rel] = data
        record_bytes = rec.text().encode("utf-8")
        if record_bytes != self.read(self.record_rel):
            changes[self.record_rel] = record_bytes
        self._record = None
        return changes


def locate(python: Optional[str] = None) -> InstalledTorch:
    """The torch of interpreter ``python`` (default: this one)."""
    python = resolve_python(python or sys.executable)
    return InstalledTorch(python, run_locate(python))
