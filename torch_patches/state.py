"""Work out where a set of files stands with respect to the series, and which
patches the base already contains (retirement).

Pure functions over ``{path: bytes | None}``; nothing here touches the disk.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional

from .errors import PatchApplyError
from .files import Files
from .patching import apply_patches, git_blob_id
from .series import Patch, Series


class State(str, enum.Enum):
    """Where the series, or one patch of it, stands on a target."""

    APPLIED = "applied"
    NOT_APPLIED = "not applied"
    #: The first k patches are applied and the rest are not (series only).
    PARTIAL = "partial"
    CONFLICTS = "conflicts"
    #: A patch the base already contains (upstream merged it): skipped, never applied.
    RETIRED = "retired"
    #: A patch whose every file is one this target does not hold (``docs/`` in an installed torch).
    NOT_PACKAGED = "not packaged"

    def __str__(self) -> str:
        return self.value


APPLIED, NOT_APPLIED, PARTIAL, CONFLICTS, RETIRED = (State.APPLIED, State.NOT_APPLIED, State.PARTIAL,
                                                     State.CONFLICTS, State.RETIRED)


@dataclass
class SeriesState:
    """The state of the whole series, and of each patch."""

    kind: State
    per_patch: Dict[str, State] = field(default_factory=dict)
    pristine: Optional[Files] = None  # the base contents, when they can be derived
    errors: Dict[str, str] = field(default_factory=dict)  # patch name -> why it conflicts

    def describe(self) -> str:
        if self.kind is PARTIAL:
            applied = [n for n, s in self.per_patch.items() if s is APPLIED]
            missing = [n for n, s in self.per_patch.items() if s is not APPLIED]
            return (f"the tree is half-applied: {', '.join(applied)} applied; "
                    f"{', '.join(missing)} not applied")
        if self.kind is CONFLICTS:
            return "; ".join(f"{n}: {why}" for n, why in self.errors.items()) or "conflicts"
        return self.kind.value


def _apply(files: Files, patches, reverse: bool = False) -> Files:
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
        return SeriesState(PARTIAL, per, pristine=pristine)
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


# -- retirement ---------------------------------------------------------------
# [Note: retired patches]
# When upstream merges a patch, a later base already contains it, and the
# series shrinks by dropping it. Until someone does, ``status``/``apply`` must
# skip it instead of failing. Only the *unmodified* base may be judged this way
# (the caller proves that: RECORD hashes, or a clean git checkout); otherwise a
# tree where someone applied the patch by hand would look "retired" too.
# A patch is retired when, in series order on the base (earlier live patches
# applied in memory), it does not apply forward and either
#   * it applies in reverse, and it adds at least one non-blank line (a patch
#     that only deletes lines reverse-applies wherever its context exists, so
#     that proves nothing), or
#   * every public ``def``/``class`` it adds is already defined in the same
#     file (upstream merged a reviewed variant of it).

_DEF_RE = re.compile(rb"^[ \t]*(?:async[ \t]+)?(?:def|class)[ \t]+([A-Za-z]\w*)")


def added_public_defs(patch: Patch) -> Dict[str, List[str]]:
    """``{path: [name, ...]}`` of the public functions/classes ``patch`` adds."""
    out: Dict[str, List[str]] = {}
    for fp in patch.files:
        for hunk in fp.hunks:
            removed = {m.group(1) for m in map(_DEF_RE.match, hunk.old) if m}
            for line in hunk.new:
                m = _DEF_RE.match(line)
                if m and m.group(1) not in removed:
                    name = m.group(1).decode()
                    if name not in out.setdefault(fp.path, []):
                        out[fp.path].append(name)
    return {p: names for p, names in out.items() if names}


def _defines(content: Optional[bytes], name: str) -> bool:
    if content is None:
        return False
    pattern = re.compile(rb"^[ \t]*(?:async[ \t]+)?(?:def|class)[ \t]+" + re.escape(name.encode()) + rb"\b",
                         re.MULTILINE)
    return pattern.search(content) is not None


def retired_reason(patch: Patch, files: Files) -> Optional[str]:
    """Why ``files`` (an unmodified base) already contains ``patch``, or ``None``."""
    try:
        _apply(files, [patch])
        return None  # it applies: live
    except PatchApplyError:
        pass
    adds = any(line.strip() for fp in patch.files for h in fp.hunks for line in h.new
               if line not in h.old)
    if adds:
        try:
            _apply(files, [patch], reverse=True)
            return "its changes are already in the base (it reverse-applies cleanly)"
        except PatchApplyError:
            pass
    defs = added_public_defs(patch)
    if defs and all(_defines(files.get(path), name) for path, names in defs.items() for name in names):
        names = ", ".join(n for names in defs.values() for n in names)
        return f"its public API is already in the base ({names})"
    return None


def find_retired(series: Series, base_files: Files) -> Dict[str, str]:
    """``{patch name: reason}`` for the patches ``base_files`` already contains.

    ``base_files`` must be the unmodified base (see [Note: retired patches]).
    Stops at the first patch that neither applies nor is retired: from there
    on, :func:`analyze` reports the conflict.
    """
    retired: Dict[str, str] = {}
    files = dict(base_files)
    for patch in series.patches:
        try:
            files = _apply(files, [patch])
            continue
        except PatchApplyError:
            pass
        reason = retired_reason(patch, files)
        if reason is None:
            break
        retired[patch.name] = reason
    return retired


def retired_in(series: Series, base_files: Files, unmodified: bool) -> Dict[str, str]:
    """``{patch name: reason}`` for the patches the base ``base_files`` contains,
    judged only when the caller proved them ``unmodified`` (see [Note: retired patches])."""
    if not series.patches or not unmodified:
        return {}
    return find_retired(series, base_files)


def patch_word(n: int) -> str:
    return f"{n} patch" + ("" if n == 1 else "es")


def retired_lines(retired: Mapping[str, str]) -> str:
    """What ``apply`` prints for the patches it skipped."""
    return "".join(f"\nskipped {name}: already in base: retired ({why})" for name, why in retired.items())


def retired_summary(retired: Mapping[str, str]) -> str:
    """What ``status`` adds to its state line."""
    return f" ({patch_word(len(retired))} already in base: retired)" if retired else ""
