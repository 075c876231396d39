"""All-or-nothing replacement of a handful of files, and the user's interpreter path.

:func:`write_files` stages every new file next to its destination first; only
when all of them are staged does it swap them in (keeping backups until the
end, so a failure midway rolls back). A read-only target fails during the
checks or the staging, before anything visible changes.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Dict, Optional

from .errors import TorchPatchesError

_TMP = ".torch_patches.tmp"
_BAK = ".torch_patches.bak"


_READ_ONLY_FS = "on a read-only file system"


def _read_only_reason(path: Path) -> Optional[str]:
    """Why ``path`` (an existing file or directory) must not be written, if so.

    A read-only mount is named as such (no user can write there). Besides
    ``os.access`` this honours missing write bits even for root, which
    ``os.access`` ignores: a tree someone made read-only is left alone.
    """
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        return exc.strerror
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return _READ_ONLY_FS
    except (OSError, AttributeError):  # no statvfs (Windows): the checks below still apply
        pass
    if not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH) or not os.access(path, os.W_OK):
        return "read-only for this user"
    return None


def check_writable(root: Path, rels) -> None:
    """Raise :class:`TorchPatchesError` if any of ``rels`` under ``root`` cannot be written.

    The advice fits the cause: a read-only file system cannot be fixed by
    running as another user, missing permissions can.
    """
    problems = []
    for rel in rels:
        target = root / rel
        directory = target.parent
        while not directory.exists() and directory != root:
            directory = directory.parent
        for p in ([target] if target.exists() else []) + [directory]:
            why = _read_only_reason(p)
            if why:
                problems.append(f"{p}: {why}")
    if not problems:
        return
    elsewhere = ("patch a copy in a virtual environment you can write (`python -m venv VENV`, install the "
                 "package there, then `--python VENV`), or build the patched wheel (`torch-patches wheel -o DIR`, "
                 "DIR anywhere writable) and install it where the environment is built")
    if any(p.endswith(_READ_ONLY_FS) for p in problems):
        advice = f"The file system is mounted read-only, so no user can change it in place: {elsewhere}."
    else:
        advice = f"Run as a user who may write there (its owner), or {elsewhere}."
    raise TorchPatchesError(
        "the target is not writable, nothing was changed:\n  " + "\n  ".join(sorted(set(problems))) + "\n" + advice)


def resolve_python(python: str) -> str:
    """The interpreter ``python`` names, as a path that works from any directory.

    A path (``.venv/bin/python``, ``../venv``) names a file from the directory
    the user ran the command in, but the interpreter is run from another one
    (:func:`.targets.installed.run_locate` runs it in the temp directory so that nothing in the
    user's directory shadows its imports), so it is made absolute here, once,
    for every caller. A virtual environment's directory stands for its
    ``bin/python`` (``Scripts/python.exe`` on Windows), and its ``bin`` directory
    for the ``python`` in it. A bare name
    (``python3``) is left to the ``PATH`` lookup, as a shell does. Symlinks
    are kept: a venv's ``bin/python`` must not become the base interpreter.
    """
    path = Path(python)
    if path.is_dir():
        for candidate in (path / "bin" / "python", path / "Scripts" / "python.exe", path / "python",
                          path / "python.exe"):
            if candidate.is_file():
                return os.path.abspath(candidate)
        if path.resolve().name in ("bin", "Scripts"):  # a venv's bin/ without an interpreter in it
            raise TorchPatchesError(f"{python} is a directory without python in it; pass the interpreter, "
                                    f"e.g. --python {path / 'python'}, or the virtual environment's directory "
                                    f"{path.parent}")
        raise TorchPatchesError(f"{python} is a directory without bin/python; pass the interpreter, "
                                f"e.g. --python {path / 'bin' / 'python'}")
    if os.sep in python or (os.altsep and os.altsep in python):
        return os.path.abspath(python)
    return python


def write_files(root: Path, changes: Dict[str, Optional[bytes]],
                mtimes: Optional[Dict[str, int]] = None) -> None:
    """Write ``changes`` (``None`` deletes) under ``root``, all or nothing.

    ``mtimes`` optionally restores modification times (ns) of written files.
    """
    root = Path(root)
    check_writable(root, changes)
    staged, made_dirs, swapped = [], [], []
    try:
        for rel, data in changes.items():
            dest = root / rel
            if data is None:
                continue
            parent = dest.parent
            missing = []
            while not parent.exists():
                missing.append(parent)
                parent = parent.parent
            for d in reversed(missing):
                d.mkdir()
                made_dirs.append(d)
            tmp = dest.with_name(dest.name + _TMP)
            with open(tmp, "wb") as fh:
                fh.write(data)
            staged.append(tmp)
            mode = dest.stat().st_mode if dest.exists() else 0o644
            os.chmod(tmp, stat.S_IMODE(mode))
            if mtimes and rel in mtimes:
                os.utime(tmp, ns=(mtimes[rel], mtimes[rel]))
    except OSError as exc:
        for tmp in staged:
            tmp.unlink(missing_ok=True)
        for d in reversed(made_dirs):
            d.rmdir()
        raise TorchPatchesError(f"cannot write under {root}: {exc}; nothing was changed")
    try:
        for rel, data in changes.items():
            dest = root / rel
            bak = dest.with_name(dest.name + _BAK)
            if dest.exists():
                os.replace(dest, bak)
                swapped.append((dest, bak))
            else:
                swapped.append((dest, None))
            if data is not None:
                os.replace(dest.with_name(dest.name + _TMP), dest)
    except OSError as exc:
        for dest, bak in reversed(swapped):
            if bak is not None:
                os.replace(bak, dest)
            else:
                dest.unlink(missing_ok=True)
        for tmp in staged:
            tmp.unlink(missing_ok=True)
        raise TorchPatchesError(f"cannot write under {root}: {exc}; nothing was changed")
    for _, bak in swapped:
        if bak is not None:
            bak.unlink(missing_ok=True)
    # A file deleted by a patch may leave its directory empty; drop it.
    for rel, data in changes.items():
        if data is None:
            parent = (root / rel).parent
            try:
                if parent != root and not any(parent.iterdir()):
                    parent.rmdir()
            except OSError:
                pass
