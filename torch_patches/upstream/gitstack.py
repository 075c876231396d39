"""A git history of the series on its pristine base, built with real git.

The one place that knows the ``git`` invocations: the base commit (tag
``base``, fixed author and date so identical inputs give identical commits),
``git am`` of patch files, and ``git format-patch`` with the flags the series
uses, writing ``NNNN-<slug>.patch`` files whose slug never ends mid-word.
Used by ``export`` (one stack per tracker) and ``tools/devtree.py`` (the
editable tree).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ..base import Base
from ..errors import TorchPatchesError
from ..files import Files
from ..series import parse_patch

FIXED_DATE = "2000-01-01T00:00:00+0000"
#: ``git format-patch`` flags of the series: no signature, zero commit ids, full
#: blob ids (the applier checks pre-images by them), no rename detection, and
#: ``Subject: [PATCH]`` without ``n/m``, so adding a patch rewrites no other file.
FORMAT_PATCH = ("format-patch", "-q", "--no-signature", "--zero-commit", "--full-index", "--no-renames",
                "--no-numbered")
#: The longest slug in ``NNNN-<slug>.patch`` (git's own limit cuts mid-word).
SLUG_MAX = 52


def git(tree: Path, *args: str, env: Optional[Dict[str, str]] = None) -> str:
    """Run git in ``tree``; raise :class:`TorchPatchesError` with its stderr."""
    proc = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})))
    if proc.returncode != 0:
        raise TorchPatchesError(f"git {' '.join(args[:2])} failed:\n{(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def identity(name: str, email: str, date: str = FIXED_DATE) -> Dict[str, str]:
    """Author and committer environment for one git command."""
    return {"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email, "GIT_AUTHOR_DATE": date,
            "GIT_COMMITTER_NAME": name, "GIT_COMMITTER_EMAIL": email, "GIT_COMMITTER_DATE": date}


def committer(tree: Path) -> Dict[str, str]:
    """A committer for ``git am`` when git has none configured (the patches carry the authors)."""
    env = {}
    for key, var, default in (("user.name", "NAME", "torch-patches"),
                              ("user.email", "EMAIL", "torch-patches@localhost")):
        proc = subprocess.run(["git", "-C", str(tree), "config", key], capture_output=True, text=True)
        if not proc.stdout.strip():
            env[f"GIT_COMMITTER_{var}"] = default
    return env


def init_base(tree: Path, files: Files, base: Base) -> None:
    """A new repository ``tree`` holding ``files`` as one commit tagged ``base``."""
    tree.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        if data is not None:
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            (tree / rel).write_bytes(data)
    git(tree, "init", "-q")
    git(tree, "config", "core.autocrlf", "false")
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "-m",
        f"torch {base.version} base ({base.git_version[:12]})\n\n"
        f"Pristine {' '.join(base.prefixes)} sources of the torch {base.version} wheel,\n"
        f"verified against its RECORD. Upstream commit {base.git_version}.",
        env=identity("PyTorch", "packages@pytorch.org"))
    git(tree, "tag", "base")


def am(tree: Path, patches: Sequence[bytes], what: str) -> None:
    """``git am`` the patch texts onto ``tree``'s HEAD (all or nothing)."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, data in enumerate(patches):
            path = Path(tmp) / f"{i:04d}.patch"
            path.write_bytes(data)
            paths.append(str(path))
        try:
            git(tree, "am", "-q", "--keep-non-patch", "--committer-date-is-author-date", *paths, env=committer(tree))
        except TorchPatchesError as exc:
            subprocess.run(["git", "-C", str(tree), "am", "--abort"], capture_output=True)
            raise TorchPatchesError(f"{what} do not apply with git am: {exc}")


def slug(subject: str, limit: int = SLUG_MAX) -> str:
    """The file-name slug of a commit subject, as git makes it, but cut at a word boundary."""
    text = re.sub(r"[^A-Za-z0-9._]+", "-", subject).strip("-.")
    text = re.sub(r"\.+", ".", text)
    if len(text) <= limit:
        return text
    cut = text[:limit + 1]
    return cut[:cut.rfind("-")] if "-" in cut else text[:limit]


def format_patch(tree: Path, revisions: str, out_dir: Path, start: int = 1) -> List[Path]:
    """``git format-patch revisions`` into ``out_dir`` as ``NNNN-<slug>.patch`` (numbered from ``start``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        git(tree, *FORMAT_PATCH, "-o", tmp, revisions)
        written = []
        for i, path in enumerate(sorted(Path(tmp).glob("*.patch")), start):
            data = path.read_bytes()
            dest = out_dir / f"{i:04d}-{slug(parse_patch(path.name, data).subject)}.patch"
            dest.write_bytes(data)
            written.append(dest)
    return written
