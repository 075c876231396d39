"""A PyTorch source tree (a checkout or release tarball of the pinned base) as a target.

The base is recognised by ``version.txt`` and, in a git checkout, by ``HEAD``
being the pinned commit. A tree without ``.git`` is recognised by
``version.txt`` plus the git blob ids of the touched files matching the
pre-images the patches name (checked by :mod:`torch_patches.ops`).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import List, Optional

from ..base import Base
from ..errors import TorchPatchesError
from ..files import Files
from ..marker import SOURCE_MARKER_NAME
from . import Target


class SourceTree(Target):
    """Files at their repo paths under ``root``."""

    kind = "source"
    packaged_only = False  # a checkout has docs/ too
    marker_rel = SOURCE_MARKER_NAME

    def __init__(self, root):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise TorchPatchesError(f"{root} is not a directory")
        version = self.read("version.txt")
        self.version = version.decode("utf-8", "replace").strip() if version is not None else ""
        self.head = self._git_head() if (self.root / ".git").exists() else None

    def _git_head(self) -> str:
        try:
            proc = subprocess.run(["git", "-C", str(self.root), "rev-parse", "HEAD"],
                                  capture_output=True, text=True, timeout=60)
        except FileNotFoundError:
            raise TorchPatchesError(f"{self.root} is a git checkout but `git` is not installed")
        return proc.stdout.strip() if proc.returncode == 0 else "?"

    def describe(self) -> List[str]:
        lines = [f"source:  {self.root}", f"version: {self.version or '(no version.txt)'}"]
        lines.append(f"commit:  {self.head}" if self.head else "commit:  (not a git checkout)")
        return lines

    @property
    def base_version(self) -> str:
        return self.version

    def base_problem(self, base: Base, action: str = "apply") -> Optional[str]:
        if not self.version:
            return f"{self.root} has no version.txt (is it a PyTorch source tree?)"
        if self.version != base.version:
            return (f"{self.root} is PyTorch {self.version}, not the pinned base {base.version}; "
                    f"check out v{base.version}")
        if self.head is not None and self.head != base.git_version:
            return (f"{self.root} is at commit {self.head[:12]}, not the pinned base "
                    f"{base.git_version[:12]} (v{base.version}); "
                    f"run `git -C {self.root} checkout v{base.version}`")
        return None

    def is_unmodified(self, files: Files) -> bool:
        """In a git checkout: the files are committed at ``HEAD`` and unedited."""
        if not self.head or self.head == "?" or self.read(SOURCE_MARKER_NAME) is not None:
            return False
        proc = subprocess.run(["git", "-C", str(self.root), "status", "--porcelain", "--", *files],
                              capture_output=True, text=True, timeout=120)
        return proc.returncode == 0 and not proc.stdout.strip()
