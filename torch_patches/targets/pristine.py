"""The pristine base files ``tools/devtree.py`` and ``export`` build their git trees from.

The ``.py`` files under the manifest's ``[base] prefixes`` come from the
pinned torch installed for an interpreter (verified against its RECORD).
Files the series touches that an installed torch does not hold (``docs/``;
outside ``[base] packaged``) come from a source checkout of the base
(``--source DIR``), verified against the pre-image blob ids the patches name.
``export`` also reads the ``[docs] file`` from there (its docs entries go into
it; no patch names its pre-image, so the check is the tree's version and commit).
"""

from __future__ import annotations

from typing import Iterable, Optional

from ..base import Base
from ..errors import TorchPatchesError
from ..files import Files
from ..series import Series
from ..state import base_blob_mismatches
from .installed import locate
from .source import SourceTree


def pristine_base_files(series: Series, python: Optional[str], source: Optional[str] = None,
                        prefixes: Optional[Iterable[str]] = None, source_files: Iterable[str] = ()) -> Files:
    """``{repo path: bytes}`` of the base: installed ``.py`` files under ``prefixes``
    (default: the manifest's) plus the source-only files the series touches, plus
    ``source_files`` read from ``source`` as they are (ignored without ``source``)."""
    files = _installed_files(python, series.base, tuple(prefixes or series.base.prefixes))
    files.update(_source_only_files(series, source))
    wanted = [p for p in source_files if p not in files]
    if source is not None and wanted:
        tree = SourceTree(source)
        problem = tree.base_problem(series.base)
        if problem:
            raise TorchPatchesError(problem)
        found = tree.read_all(wanted)
        missing = [p for p, d in found.items() if d is None]
        if missing:
            raise TorchPatchesError(f"{', '.join(missing)}: missing in {tree.root} (the --source checkout); "
                                    "the series' docs entries go into it")
        files.update(found)
    return files


def _source_only_files(series: Series, source: Optional[str]) -> Files:
    first = {}
    for fp in series.file_patches:
        if not series.base.is_packaged(fp.path):
            first.setdefault(fp.path, fp)
    needed = [path for path, fp in first.items() if not fp.creates]
    if not needed:
        return {}
    if source is None:
        raise TorchPatchesError(
            f"the series changes {', '.join(needed)}, which an installed torch does not hold; pass "
            f"--source DIR (a v{series.base.version} checkout) for the base content of those files")
    tree = SourceTree(source)
    problem = tree.base_problem(series.base)
    if problem:
        raise TorchPatchesError(problem)
    files = tree.read_all(needed)
    problems = [f"{p}: missing in {tree.root}" for p, d in files.items() if d is None]
    problems += base_blob_mismatches(series.restricted(lambda path: path in files), files)
    if problems:
        raise TorchPatchesError("the source tree's files are not the base the series expects:\n  "
                                + "\n  ".join(problems))
    return files


def _installed_files(python: Optional[str], base: Base, prefixes) -> Files:
    """``{repo path: bytes}`` of the installed base's ``.py`` files under ``prefixes``, RECORD-verified.

    If that torch was patched in place with this tool, the pristine copies its
    marker keeps are used; a torch edited by hand is refused.
    """
    target = locate(python)
    if target.kind == "wheel":
        raise TorchPatchesError(
            f"torch {target.dist_version} was installed from a patched wheel; its pristine files are "
            f"not available. Use an interpreter with torch=={base.version} (--python PY).")
    problem = target.base_problem(base)
    if problem:
        raise TorchPatchesError(problem)
    rels = [row.path for row in target.record().rows() if row.path.startswith(prefixes) and row.path.endswith(".py")]
    files = target.read_all(rels)
    old = target.load_marker()
    if old is not None:
        changed = old.changed_since(target.read_all(old.files))
        if changed:
            raise TorchPatchesError(f"files changed after the series was applied: {', '.join(changed)}")
        files.update({p: d for p, d in old.pristine_files().items() if p in files})
    problems = target.verify_pristine(files)
    if problems:
        raise TorchPatchesError(
            f"the torch of {target.executable} does not match its RECORD (edited in place?):\n  "
            + "\n  ".join(problems[:10])
            + f"\nUse an interpreter with an unmodified torch=={base.version} (--python PY).")
    return files
