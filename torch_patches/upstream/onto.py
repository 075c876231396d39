"""``export --onto DIR``: does the exported stack apply to another PyTorch tree?

Each exported patch (in ``DIR/series`` order) is checked against the files of
the other tree with the strict applier of :mod:`torch_patches.patching`, on
top of the patches before it: *applies cleanly*, *applies with offsets* (which
hunk moved by how many lines), *conflicts* (which file and hunk), or *already
in tree* (it reverse-applies: upstream merged it; see
:func:`torch_patches.state.retired_reason`). Nothing is written to the tree.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Tuple

from ..errors import PatchApplyError, TorchPatchesError
from ..files import Files
from ..patching import apply_patches, locate_hunks
from ..series import NESTED_PATCH_NAME, parse_patch, read_series_file
from ..state import retired_reason

CLEAN, OFFSETS, CONFLICTS, IN_TREE = "applies cleanly", "applies with offsets", "conflicts", "already in tree"


def stack_order(export_dir: Path) -> List[Path]:
    """The exported patches in ``git am`` order (``export_dir/series``)."""
    if not (export_dir / "series").is_file():
        raise TorchPatchesError(f"{export_dir} has no series file; run `torch-patches export` first")
    return [export_dir / name for name in read_series_file(export_dir, NESTED_PATCH_NAME).names]


def check_patch(files: Files, path: Path) -> Tuple[str, List[str], Files]:
    """``(verdict, details, files after the patch)`` for one patch on ``files``."""
    patch = parse_patch(path.name, path.read_bytes())
    details: List[str] = []
    verdict = CLEAN
    for fp in patch.files:
        content = files.get(fp.path)
        if fp.creates and content is not None:
            verdict = CONFLICTS
            details.append(f"{fp.path}: already exists (the patch creates it)")
            continue
        if content is None and not fp.creates:
            verdict = CONFLICTS
            details.append(f"{fp.path}: does not exist in the tree")
            continue
        for hunk, offset in zip(fp.hunks, locate_hunks(content, fp)):
            if offset is None:
                verdict = CONFLICTS
                details.append(f"{fp.path}: {hunk.header} does not match")
            elif offset:
                verdict = OFFSETS if verdict == CLEAN else verdict
                details.append(f"{fp.path}: {hunk.header} found {offset:+d} lines away")
    if verdict == CONFLICTS:
        reason = retired_reason(patch, files)
        if reason is not None:
            return IN_TREE, [reason], files
        return verdict, details, files
    try:
        files = apply_patches(files, patch.files, where=path.name)
    except PatchApplyError as exc:  # cannot happen when every hunk was located; be safe
        return CONFLICTS, [str(exc)], files
    return verdict, details, files


def check_onto(export_dir: Path, tree: Path) -> Tuple[List[str], bool]:
    """Report lines and whether every patch applies (cleanly, with offsets or already in tree)."""
    tree = Path(tree)
    if not tree.is_dir():
        raise TorchPatchesError(f"--onto {tree}: not a directory")
    patches = stack_order(Path(export_dir))
    version = (tree / "version.txt").read_text().strip() if (tree / "version.txt").is_file() else "?"
    lines = [f"onto {tree} (version.txt: {version})"]
    files: Files = {}
    ok = True
    for path in patches:
        for fp in parse_patch(path.name, path.read_bytes()).files:
            if fp.path not in files:
                p = tree / fp.path
                files[fp.path] = p.read_bytes() if p.is_file() else None
        verdict, details, files = check_patch(files, path)
        ok = ok and verdict != CONFLICTS
        rel = f"{path.parent.name}/{path.name}"
        lines.append(f"  {verdict:<22} {rel}")
        lines += [f"  {'':<22}   {d}" for d in details]
    lines.append("onto: every patch applies" if ok else
                 "onto: CONFLICTS; later verdicts assume the conflicting patches were skipped")
    return lines, ok
