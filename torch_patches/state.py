"""Work out where a set of files stands with respect to the series.

Pure functions over ``{path: bytes | None}``; nothing here touches the disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .errors import PatchApplyError
from .patching import Files, apply_patches, git_blob_id
from .series import Patch, Series

APPLIED, NOT_APPLIED, CONFLICTS = "applied", "not applied", "conflicts"


@dataclass
class SeriesState:
    """``kind`` is ``applied``, ``not applied``, ``partial`` or ``conflicts``."""

    kind: str
    per_patch: Dict[str, str] = field(default_factory=dict)
    pristine: Optional[Files] = None  # the base contents, when they can be derived
    errors: Dict[str, str] = field(default_factory=dict)  # patch name -> why it conflicts

    def describe(self) -> str:
        if self.kind == "partial":
            applied = [n for n, s in self.per_patch.items() if s == APPLIED]
            missing = [n for n, s in self.per_patch.items() if s != APPLIED]
            return (f"the tree is half-applied: {', '.join(applied)} applied; "
                    f"{', '.join(missing)} not applied")
        if self.kind == CONFLICTS:
            return "; ".join(f"{n}: {why}" for n, why in self.errors.items()) or "conflicts"
        return self.kind


def _apply(files: Files, patches: List[Patch], reverse: bool = False) -> Files:
    for patch in (reversed(patches) if reverse else patches):
        files = apply_patches(files, patch.files, where=patch.name, reverse=reverse)
    return files


def analyze(series: Series, current: Files) -> SeriesState:
    """Classify ``current`` (the contents of ``series.paths``).

    * ``not applied``: the whole series applies forward;
    * ``applied``: the whole series applies in reverse;
    * ``partial``: the first k patches are applied and the rest are not;
    * ``conflicts``: none of the above; ``errors`` says which hunks fail.

    When both directions work (only possible for an empty series or a
    degenerate patch), ``not applied`` wins unless the caller knows better.
    """
    patches = series.patches
    names = [p.name for p in patches]
    try:
        _apply(current, patches)
        return SeriesState(NOT_APPLIED, {n: NOT_APPLIED for n in names}, pristine=dict(current))
    except PatchApplyError:
        pass
    try:
        pristine = _apply(current, patches, reverse=True)
        return SeriesState(APPLIED, {n: APPLIED for n in names}, pristine=pristine)
    except PatchApplyError:
        pass
    for k in range(len(patches) - 1, 0, -1):
        try:
            pristine = _apply(current, patches[:k], reverse=True)
            _apply(pristine, patches)
        except PatchApplyError:
            continue
        per = {n: (APPLIED if i < k else NOT_APPLIED) for i, n in enumerate(names)}
        return SeriesState("partial", per, pristine=pristine)
    per, errors = {}, {}
    files = current
    for patch in patches:  # the first patch that fails when applied in order
        try:
            files = _apply(files, [patch])
        except PatchApplyError as exc:
            errors[patch.name] = str(exc)
            break
    for patch in patches:
        subset = {p: current.get(p) for p in patch.paths}
        try:
            _apply(subset, [patch])
            per[patch.name] = NOT_APPLIED
            continue
        except PatchApplyError as exc:
            forward_error = str(exc)
        try:
            _apply(subset, [patch], reverse=True)
            per[patch.name] = APPLIED
        except PatchApplyError:
            per[patch.name] = CONFLICTS
            errors.setdefault(patch.name, forward_error)
    return SeriesState(CONFLICTS, per, errors=errors)


def apply_series(series: Series, pristine: Files) -> Files:
    """The patched contents; raises :class:`PatchApplyError` (nothing written)."""
    return _apply(pristine, series.patches)


def base_blob_mismatches(series: Series, pristine: Files) -> List[str]:
    """Files whose pristine content differs from the pre-image the patches name.

    ``git format-patch`` records the git blob id of each file before the
    change (``index <old>..<new>``); the first patch that touches a file names
    its base-version blob. Returns human-readable mismatches (empty: all good).
    """
    seen, problems = set(), []
    for fp in series.file_patches:
        if fp.path in seen:
            continue
        seen.add(fp.path)
        content = pristine.get(fp.path)
        if fp.creates or not fp.old_blob or content is None or set(fp.old_blob) == {"0"}:
            continue
        blob = git_blob_id(content)
        if not blob.startswith(fp.old_blob):
            problems.append(f"{fp.path} is blob {blob[:12]}, the series expects {fp.old_blob[:12]}")
    return problems
