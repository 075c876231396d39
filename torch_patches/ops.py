"""``apply``, ``revert``, ``status`` and ``check`` on a :class:`Target`.

Every operation first computes the complete result in memory and only then
writes, through one all-or-nothing :meth:`Target.commit`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from . import marker as markers
from .errors import PatchApplyError, TorchPatchesError
from .patching import Files
from .series import Series
from .state import (APPLIED, CONFLICTS, NOT_APPLIED, RETIRED, analyze, apply_series, base_blob_mismatches,
                    find_retired)
from .target import Target

REFUSED = 3  # exit code for "this is not the pinned base torch"
NOTHING_CHANGED = "Nothing was changed."


@dataclass
class Plan:
    """The outcome of an apply, computed without writing anything."""

    already: bool = False
    message: str = ""
    pristine: Files = field(default_factory=dict)
    new: Files = field(default_factory=dict)
    marker: Optional[dict] = None


def _patch_word(n: int) -> str:
    return f"{n} patch" + ("" if n == 1 else "es")


def _retired(target: Target, series: Series, base_files: Files) -> Dict[str, str]:
    """Patches the unmodified base already contains (see [Note: retired patches])."""
    if not series.patches or not target.is_unmodified(base_files):
        return {}
    return find_retired(series, base_files)


def _retired_lines(retired: Dict[str, str]) -> str:
    return "".join(f"\nskipped {name}: already in base: retired ({why})" for name, why in retired.items())


def _refuse_if_not_base(target: Target, series: Series, action: str) -> None:
    if target.kind == "wheel":
        old = target.load_marker()
        if action == "apply" and old is not None and markers.same_series(old, series):
            return
        raise TorchPatchesError(
            f"torch was installed from a patched wheel ({getattr(target, 'dist_version', '?')}); "
            f"cannot {action} in place. Reinstall the base with "
            f"`pip install --force-reinstall --no-deps torch=={series.base.version}` "
            f"or install the wheel for series revision {series.revision}. {NOTHING_CHANGED}",
            REFUSED)
    problem = target.base_problem(series.base)
    if problem:
        raise TorchPatchesError(f"refusing to {action}: {problem}. {NOTHING_CHANGED}", REFUSED)


def plan_apply(target: Target, series: Series) -> Plan:
    """Work out what ``apply`` would write; raise if it cannot."""
    _refuse_if_not_base(target, series, "apply")
    old = target.load_marker()
    if target.kind == "wheel":
        return Plan(already=True, message=f"already applied: torch {target.dist_version} "  # type: ignore[attr-defined]
                                          f"was installed from the patched wheel ({markers.describe(old)})")
    paths = list(dict.fromkeys(list(series.paths) + list(old["files"] if old else [])))
    current = target.read_all(paths)
    replacing = ""
    if old is not None:
        changed = markers.changed_since(old, current)
        if changed:
            raise TorchPatchesError(
                f"these files changed after {markers.describe(old)} was applied: {', '.join(changed)}. "
                "Restore them (reinstall torch or check out the files) and apply again. " + NOTHING_CHANGED)
        if markers.same_series(old, series):
            return Plan(already=True, message=f"already applied: {markers.describe(old)}")
        pristine = {**current, **markers.pristine_files(old)}
        mtimes = {**target.mtimes(p for p in paths if p not in old["files"]), **markers.pristine_mtimes(old)}
        replacing = f" (replacing {markers.describe(old)})"
        retired = _retired(target, series, pristine)
        live = series.without(retired)
    else:
        retired = _retired(target, series, current)
        live = series.without(retired)
        if retired and not live.patches:
            return Plan(already=True, message="nothing to apply: every patch is already in base: retired"
                                              + _retired_lines(retired))
        state = analyze(live, current)
        if state.kind == "partial":
            raise TorchPatchesError(
                f"{state.describe()}. Run `torch-patches revert` to restore the pristine files, "
                f"then apply. {NOTHING_CHANGED}")
        if state.kind == CONFLICTS:
            raise TorchPatchesError(
                "the series does not apply:\n  " + "\n  ".join(f"{n}: {why}" for n, why in state.errors.items())
                + f"\n{NOTHING_CHANGED}")
        pristine = state.pristine or {}
        mtimes = target.mtimes(paths)
    problems = target.verify_pristine(pristine) + base_blob_mismatches(live, pristine)
    if problems:
        raise TorchPatchesError(
            "the files to patch are not the pristine base files:\n  " + "\n  ".join(problems)
            + f"\nReinstall torch=={series.base.version} (or use a clean v{series.base.version} tree). "
            + NOTHING_CHANGED)
    try:
        new = apply_series(live, pristine)
    except PatchApplyError as exc:
        raise TorchPatchesError(f"{exc}. {NOTHING_CHANGED}")
    marker = markers.build(series, pristine, new, kind=target.kind, mtimes=mtimes)
    if retired:
        marker["retired"] = retired
    already = new == current and old is None and bool(live.patches)
    what = f"series revision {series.revision}: {_patch_word(len(live.patches))}"
    message = (f"already applied ({what}); recorded it" if already else f"applied {what}{replacing}")
    message += _retired_lines(retired)
    return Plan(already=False, message=message, pristine=pristine, new=new, marker=marker)


def apply(target: Target, series: Series) -> str:
    """Apply ``series`` to ``target`` (idempotent, all or nothing)."""
    plan = plan_apply(target, series)
    if not plan.already:
        target.commit(plan.pristine, plan.new, plan.marker)
    return plan.message


def revert(target: Target, series: Series) -> str:
    """Restore the pristine base files (and RECORD) of ``target``."""
    _refuse_if_not_base(target, series, "revert")
    old = target.load_marker()
    if old is not None:
        current = target.read_all(old["files"])
        changed = markers.changed_since(old, current)
        if changed:
            raise TorchPatchesError(
                f"these files changed after {markers.describe(old)} was applied: {', '.join(changed)}; "
                f"reinstall torch=={series.base.version} instead. {NOTHING_CHANGED}")
        pristine = markers.pristine_files(old)
        what = markers.describe(old)
    else:
        current = target.read_all(series.paths)
        retired = _retired(target, series, current)
        state = analyze(series.without(retired), current)
        if state.kind == NOT_APPLIED:
            return "nothing to revert: the series is not applied" + (
                f" ({len(retired)} already in base: retired)" if retired else "")
        if state.kind == CONFLICTS:
            raise TorchPatchesError(
                "cannot revert, the files match neither the base nor the series:\n  "
                + "\n  ".join(f"{n}: {why}" for n, why in state.errors.items()) + f"\n{NOTHING_CHANGED}")
        pristine = state.pristine or {}
        applied = [n for n, s in state.per_patch.items() if s == APPLIED]
        what = ", ".join(applied)
    problems = target.verify_pristine(pristine)
    if problems:
        raise TorchPatchesError("the restored files would not match the base:\n  " + "\n  ".join(problems)
                                + f"\n{NOTHING_CHANGED}")
    target.commit(pristine, None, None)
    return f"reverted {what}"


def patch_states(target: Target, series: Series, reasons: Optional[Dict[str, str]] = None):
    """``{patch name: applied | not applied | conflicts | retired}`` and a summary line.

    ``reasons``, when given, receives why each retired patch is retired.
    """
    reasons = {} if reasons is None else reasons
    old = target.load_marker()
    current = target.read_all(series.paths)
    if old is not None and markers.same_series(old, series) \
            and not markers.changed_since(old, target.read_all(old["files"])):
        reasons.update(old.get("retired") or {})
        per = {p.name: (RETIRED if p.name in reasons else APPLIED) for p in series.patches}
        return per, "applied" + _retired_summary(reasons, series)
    reasons.update(_retired(target, series, current))
    state = analyze(series.without(reasons), current)
    per = {p.name: (RETIRED if p.name in reasons else state.per_patch.get(p.name, "?")) for p in series.patches}
    if old is not None and not markers.same_series(old, series):
        return per, _other_series(old, series, target)
    if not series.patches:
        return {}, "empty series" + (" (recorded as applied)" if old else "")
    if reasons and len(reasons) == len(series.patches):
        return per, "every patch is already in base: retired"
    return per, state.describe() + _retired_summary(reasons, series)


def _other_series(old: dict, series: Series, target: Target) -> str:
    """What ``status`` says when the recorded series is not ``series``."""
    recorded = old["series"]["revision"]
    how = ("build and install its wheel (`torch-patches wheel`)" if target.kind == "wheel"
           else "`apply` upgrades to it in one step")
    if recorded < series.revision:
        return f"{markers.describe(old)} is applied; a newer series exists (revision {series.revision}): {how}"
    if recorded > series.revision:
        return (f"{markers.describe(old)} is applied, newer than this series (revision {series.revision}); "
                "`apply` would replace it with this older one")
    return f"{markers.describe(old)} is applied; `apply` replaces it with this series"


def _retired_summary(reasons: Dict[str, str], series: Series) -> str:
    if not reasons:
        return ""
    return f" ({_patch_word(len(reasons))} already in base: retired)"


def status(target: Target, series: Series) -> List[str]:
    """Human-readable status lines."""
    lines = list(target.describe())
    problem = target.base_problem(series.base) if target.kind != "wheel" else None
    if target.kind == "wheel":
        lines.append(f"pinned base: patched wheel {getattr(target, 'dist_version', '?')} "
                     f"of the base {series.base.version} ({series.base.git_version[:12]})")
    elif problem:
        lines.append(f"pinned base: NO: {problem}")
    else:
        lines.append(f"pinned base: yes ({series.base.version}, {series.base.git_version[:12]})")
    old = target.load_marker()
    if old is not None:
        lines.append(f"recorded:    {markers.describe(old)} ({old.get('kind')})")
    lines.append(f"series:      revision {series.revision}, {_patch_word(len(series.patches))} "
                 f"from {series.directory}")
    if problem:
        return lines
    reasons: Dict[str, str] = {}
    per, summary = patch_states(target, series, reasons)
    lines.append(f"state:       {summary}")
    for patch in series.patches:
        lines.append(f"  {per.get(patch.name, '?'):<12} {patch.name}  {patch.subject}")
        if patch.name in reasons:
            lines.append(f"  {'':<12} already in base: retired ({reasons[patch.name]}); "
                         "drop it from the series")
        missing = patch.missing_dep3()
        if missing:
            lines.append(f"  {'':<12} warning: missing DEP-3 field(s): {', '.join(missing)}")
    return lines


def check(target: Target, series: Series):
    """Dry run of apply. Returns ``(lines, error)``; ``error`` is ``None`` when apply would succeed."""
    lines = list(target.describe())
    try:
        plan = plan_apply(target, series)
        error = None
    except TorchPatchesError as exc:
        plan, error = None, exc
    per = {}
    if error is None or error.exit_code != REFUSED:
        per, summary = patch_states(target, series)
        lines.append(f"state: {summary}")
    for patch in series.patches:
        state = per.get(patch.name, "?")
        if state == NOT_APPLIED and error is None:
            state = "applies cleanly"
        lines.append(f"  {state:<16} {patch.name}  {patch.subject}")
    if plan is not None:
        if plan.already or plan.message.startswith("already"):
            lines.append(f"ok: {plan.message}")
        else:
            changed = [p for p in plan.new if plan.new[p] != plan.pristine.get(p)]
            lines.append(f"ok: apply would succeed ({_patch_word(len(series.patches))}, "
                         f"{len(changed)} files change)")
    return lines, error
