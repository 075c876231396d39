"""``apply``, ``revert``, ``status`` and ``check`` on a :class:`~torch_patches.targets.Target`.

Every operation first computes the complete result in memory and only then
writes, through one all-or-nothing :meth:`Target.commit`. A target that holds
only what a wheel packages (an installed torch) gets the series without the
hunks for other paths (``docs/``): see :func:`held_series`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .errors import PatchApplyError, TorchPatchesError
from .files import Files
from .marker import Marker
from .series import Series
from .state import (APPLIED, CONFLICTS, NOT_APPLIED, PARTIAL, RETIRED, State, analyze, apply_series,
                    base_blob_mismatches, patch_word, retired_in, retired_lines, retired_summary)
from .targets import Target

REFUSED = 3  # exit code for "this is not the pinned base torch"
NOTHING_CHANGED = "Nothing was changed."


class Outcome(enum.Enum):
    """What an ``apply`` will do."""

    WRITE = "write"  # patch the files and write the marker
    RECORD = "record"  # the files are already patched: write only the marker
    NOTHING = "nothing"  # already applied, or every patch is retired


@dataclass(frozen=True)
class Plan:
    """The outcome of an apply, computed without writing anything."""

    outcome: Outcome
    message: str
    pristine: Files = field(default_factory=dict)
    new: Files = field(default_factory=dict)
    marker: Optional[Marker] = None


@dataclass(frozen=True)
class _Start:
    """Where an apply starts from: the base files, and what the target holds now."""

    current: Files
    pristine: Files
    mtimes: Dict[str, int]
    retired: Dict[str, str]
    replacing: Optional[Marker] = None


# -- the series a target can hold ------------------------------------------------------
def held_series(target: Target, series: Series) -> Tuple[Series, List[str]]:
    """``series`` without the file diffs ``target`` cannot hold, and those paths.

    An installed torch (or a wheel) has no ``docs/``: hunks for paths outside
    the manifest's ``[base] packaged`` prefixes apply to source checkouts and go
    to the export, and are skipped here.
    """
    if not target.packaged_only:
        return series, []
    skipped = [p for p in series.paths if not series.base.is_packaged(p)]
    return (series.restricted(series.base.is_packaged), skipped) if skipped else (series, [])


def _skipped_lines(skipped: List[str]) -> str:
    return "".join(f"\nskipped {path}: not part of an installed torch or wheel (source checkouts and "
                   "export include it)" for path in skipped)


# -- refusals ---------------------------------------------------------------------------------
def reinstall_command(target: Target, version: str) -> str:
    """The command that puts the unpatched base back into ``target``'s environment: pip of the
    target's interpreter, forced (pip counts an in-place patched torch, and a patched wheel's
    ``2.15.0+...fsdp.N``, as ``2.15.0`` already installed)."""
    python = getattr(target, "python", None)
    pip = f"{python} -m pip" if python else "pip"
    return f"`{pip} install --force-reinstall --no-deps torch=={version}`"


def _restore_how(target: Target, version: str) -> str:
    """How to restore files edited by hand: reinstall (an installed torch), or check them out."""
    if target.kind == "source":
        return "check the files out (`git checkout -- FILE`) or use a clean tree"
    return "reinstall torch: " + reinstall_command(target, version)


def _refuse_if_not_base(target: Target, series: Series, action: str) -> None:
    if target.kind == "wheel":
        old = target.load_marker()
        if action == "apply" and old is not None and old.same_series(series):
            return
        reinstall = (f"{reinstall_command(target, series.base.version)} (a plain "
                     f"`pip install torch=={series.base.version}` counts the installed patched build as "
                     f"{series.base.version})")
        if action == "revert":
            how = f"To get the unpatched base back, reinstall it: {reinstall}."
        else:
            how = (f"Build and install the wheel of series revision {series.revision} (`torch-patches wheel`, "
                   f"then `pip install` the file it wrote), or reinstall the base with {reinstall} and apply.")
        raise TorchPatchesError(
            f"torch {getattr(target, 'dist_version', '?')} was installed from a patched wheel "
            f"({old.describe() if old is not None else 'no marker'}); {action} does not change it in place. "
            f"{how} {NOTHING_CHANGED}", REFUSED)
    problem = target.base_problem(series.base, action)
    if problem:
        raise TorchPatchesError(f"refusing to {action}: {problem}. {NOTHING_CHANGED}", REFUSED)


def _refuse_if_changed(old: Marker, current: Files, fix: str) -> None:
    changed = old.changed_since(current)
    if changed:
        raise TorchPatchesError(f"these files changed after {old.describe()} was applied: "
                                f"{', '.join(changed)}. {fix} {NOTHING_CHANGED}")


# -- apply ---------------------------------------------------------------------------------------
def _start_from_marker(target: Target, series: Series, old: Marker, paths: List[str]) -> _Start:
    """Replacing another recorded series: its marker keeps the base files."""
    current = target.read_all(paths)
    pristine = {**current, **old.pristine_files()}
    mtimes = {**target.mtimes(p for p in paths if p not in old.files), **old.pristine_mtimes()}
    retired = retired_in(series, pristine, target.is_unmodified(pristine))
    return _Start(current, pristine, mtimes, retired, replacing=old)


def _start_from_files(target: Target, series: Series, paths: List[str]) -> _Start:
    """No marker: the files must be the base, or the whole live series applied by hand."""
    current = target.read_all(paths)
    retired = retired_in(series, current, target.is_unmodified(current))
    state = analyze(series.without(retired), current)
    if state.kind is PARTIAL:
        raise TorchPatchesError(f"{state.describe()}. Run `torch-patches revert` to restore the pristine "
                                f"files, then apply. {NOTHING_CHANGED}")
    if state.kind is CONFLICTS:
        raise TorchPatchesError("the series does not apply:\n  " + "\n  ".join(
            f"{n}: {why}" for n, why in state.errors.items()) + f"\n{NOTHING_CHANGED}")
    return _Start(current, state.pristine or {}, target.mtimes(paths), retired)


def _patched(target: Target, live: Series, pristine: Files) -> Files:
    """The patched files, after proving ``pristine`` is the base."""
    problems = target.verify_pristine(pristine) + base_blob_mismatches(live, pristine)
    if problems:
        raise TorchPatchesError(
            "the files to patch are not the pristine base files:\n  " + "\n  ".join(problems)
            + f"\nReinstall torch=={live.base.version} (or use a clean v{live.base.version} tree). "
            + NOTHING_CHANGED)
    try:
        return apply_series(live, pristine)
    except PatchApplyError as exc:
        raise TorchPatchesError(f"{exc}. {NOTHING_CHANGED}")


def plan_apply(target: Target, series: Series) -> Plan:
    """Work out what ``apply`` would write; raise if it cannot."""
    _refuse_if_not_base(target, series, "apply")
    old = target.load_marker()
    if target.kind == "wheel":
        assert old is not None
        return Plan(Outcome.NOTHING, f"already applied: torch {getattr(target, 'dist_version', '?')} "
                                     f"was installed from the patched wheel ({old.describe()})")
    held, skipped = held_series(target, series)
    paths = list(dict.fromkeys([*held.paths, *(old.files if old else [])]))
    if old is not None:
        _refuse_if_changed(old, target.read_all(old.files),
                           f"Restore them ({_restore_how(target, series.base.version)}) and apply again.")
        if old.same_series(series):
            return Plan(Outcome.NOTHING, f"already applied: {old.describe()}")
        start = _start_from_marker(target, held, old, paths)
    else:
        start = _start_from_files(target, held, paths)
        if start.retired and len(start.retired) == len(series.patches):
            return Plan(Outcome.NOTHING, "nothing to apply: every patch is already in base: retired"
                                         + retired_lines(start.retired))
    live = held.without(start.retired)
    new = _patched(target, live, start.pristine)
    marker = Marker.build(series, start.pristine, new, kind=target.kind, mtimes=start.mtimes,
                          retired=start.retired)
    what = f"series revision {series.revision}: {patch_word(len(live.patches))}"
    if new == start.current and old is None and live.patches:
        outcome, message = Outcome.RECORD, f"already applied ({what}); recorded it"
    else:
        outcome = Outcome.WRITE
        message = f"applied {what}" + (f" (replacing {start.replacing.describe()})" if start.replacing else "")
    message += retired_lines(start.retired) + _skipped_lines(skipped)
    return Plan(outcome, message, start.pristine, new, marker)


def apply(target: Target, series: Series) -> str:
    """Apply ``series`` to ``target`` (idempotent, all or nothing)."""
    plan = plan_apply(target, series)
    if plan.outcome is not Outcome.NOTHING:
        target.commit(plan.pristine, plan.new, plan.marker)
    return plan.message


# -- revert -------------------------------------------------------------------------------------------
def revert(target: Target, series: Series) -> str:
    """Restore the pristine base files (and RECORD) of ``target``."""
    _refuse_if_not_base(target, series, "revert")
    old = target.load_marker()
    if old is not None:
        _refuse_if_changed(old, target.read_all(old.files),
                           f"To get the base back, {_restore_how(target, series.base.version)}.")
        pristine, what = old.pristine_files(), old.describe()
    else:
        held, _ = held_series(target, series)
        current = target.read_all(held.paths)
        retired = retired_in(held, current, target.is_unmodified(current))
        state = analyze(held.without(retired), current)
        if state.kind is NOT_APPLIED:
            return "nothing to revert: the series is not applied" + (
                f" ({len(retired)} already in base: retired)" if retired else "")
        if state.kind is CONFLICTS:
            raise TorchPatchesError(
                "cannot revert, the files match neither the base nor the series:\n  "
                + "\n  ".join(f"{n}: {why}" for n, why in state.errors.items()) + f"\n{NOTHING_CHANGED}")
        pristine = state.pristine or {}
        what = f"series revision {series.revision}, " + patch_word(
            sum(s is APPLIED for s in state.per_patch.values()))
    problems = target.verify_pristine(pristine)
    if problems:
        raise TorchPatchesError("the restored files would not match the base:\n  " + "\n  ".join(problems)
                                + f"\n{NOTHING_CHANGED}")
    target.commit(pristine, None, None)
    return f"reverted {what}"


# -- status ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PatchStates:
    """Each patch's state, the summary line, and why retired patches are retired."""

    per_patch: Dict[str, State]
    summary: str
    retired: Dict[str, str]
    skipped: List[str]


def _other_series(old: Marker, series: Series, target: Target) -> str:
    """What ``status`` says when the recorded series is not ``series``."""
    how = ("build and install its wheel (`torch-patches wheel`)" if target.kind == "wheel"
           else "`apply` upgrades to it in one step")
    ours = series.identity()["patches"]
    if old.revision == series.revision and old.patches and len(old.patches) < len(ours) \
            and old.identity()["patches"] == ours[:len(old.patches)]:
        return (f"the first {patch_word(len(old.patches))} of this series are applied (`apply --upto "
                f"{len(old.patches)}`); `apply` adds the other {len(ours) - len(old.patches)}")
    if old.revision < series.revision:
        return f"{old.describe()} is applied; a newer series exists (revision {series.revision}): {how}"
    if old.revision > series.revision:
        return (f"{old.describe()} is applied, newer than this series (revision {series.revision}); "
                "`apply` would replace it with this older one")
    return (f"{old.describe()} is applied, with other patches than this series' revision "
            f"{series.revision} (a development build of the same revision); "
            "`apply` replaces it with this series")


def patch_states(target: Target, series: Series) -> PatchStates:
    """Where each patch stands on ``target``, with a one-line summary."""
    held, skipped = held_series(target, series)
    not_held = {p.name for p in held.patches if not p.files}
    old = target.load_marker()
    if old is not None and old.same_series(series) and not old.changed_since(target.read_all(old.files)):
        retired = dict(old.retired)
        per = {p.name: RETIRED if p.name in retired else APPLIED for p in series.patches}
        return PatchStates(per, "applied" + retired_summary(retired), retired, skipped)
    current = target.read_all(held.paths)
    retired = retired_in(held, current, target.is_unmodified(current))
    state = analyze(held.without(retired), current)
    per = {p.name: (RETIRED if p.name in retired else State.NOT_PACKAGED if p.name in not_held
                    else state.per_patch.get(p.name, CONFLICTS)) for p in series.patches}
    changed = old.changed_since(target.read_all(old.files)) if old is not None else []
    if old is not None and changed:
        summary = (f"{old.describe()} is recorded, but {len(changed)} file(s) changed since it was applied: "
                   f"{', '.join(changed)}. `apply` and `revert` refuse (and change nothing) until they are "
                   f"restored: {_restore_how(target, series.base.version)}")
    elif old is not None:
        summary = _other_series(old, series, target)
    elif not series.patches:
        summary = "empty series"
    elif retired and len(retired) == len(series.patches):
        summary = "every patch is already in base: retired"
    else:
        summary = state.describe() + retired_summary(retired)
    return PatchStates(per, summary, retired, skipped)


def _pin_line(target: Target, series: Series) -> Tuple[str, Optional[str]]:
    if target.kind == "wheel":
        return (f"pinned base: patched wheel {getattr(target, 'dist_version', '?')} "
                f"of the base {series.base.version} ({series.base.git_version[:12]})"), None
    problem = target.base_problem(series.base)
    if problem:
        return f"pinned base: NO: {problem}", problem
    return f"pinned base: yes ({series.base.version}, {series.base.git_version[:12]})", None


def status(target: Target, series: Series) -> List[str]:
    """Human-readable status lines."""
    lines = list(target.describe())
    pin, problem = _pin_line(target, series)
    lines.append(pin)
    old = target.load_marker()
    if old is not None:
        lines.append(f"recorded:    {old.describe()} ({old.kind})")
    lines.append(f"series:      revision {series.revision}, {patch_word(len(series.patches))} "
                 f"from {series.directory}")
    if problem:
        return lines
    states = patch_states(target, series)
    lines.append(f"state:       {states.summary}")
    for patch in series.patches:
        lines.append(f"  {states.per_patch.get(patch.name, '?')!s:<12} {patch.name}  {patch.subject}")
        if patch.name in states.retired:
            lines.append(f"  {'':<12} already in base: retired ({states.retired[patch.name]}); "
                         "drop it from the series")
        missing = patch.missing_dep3()
        if missing:
            lines.append(f"  {'':<12} warning: missing DEP-3 field(s): {', '.join(missing)}")
    for path in states.skipped:
        lines.append(f"note:        {path} is not part of an installed torch or wheel: skipped here "
                     "(source checkouts and export include it)")
    return lines


def check(target: Target, series: Series) -> Tuple[List[str], Optional[TorchPatchesError]]:
    """Dry run of apply. Returns ``(lines, error)``; ``error`` is ``None`` when apply would succeed."""
    lines = list(target.describe())
    try:
        plan: Optional[Plan] = plan_apply(target, series)
        error = None
    except TorchPatchesError as exc:
        plan, error = None, exc
    per: Dict[str, State] = {}
    if error is None or error.exit_code != REFUSED:
        states = patch_states(target, series)
        per = states.per_patch
        lines.append(f"state: {states.summary}")
    for patch in series.patches:
        state = per.get(patch.name, "?")
        shown = "applies cleanly" if state is NOT_APPLIED and error is None else str(state)
        lines.append(f"  {shown:<16} {patch.name}  {patch.subject}")
    if plan is not None:
        if plan.outcome is Outcome.WRITE:
            changed = [p for p in plan.new if plan.new[p] != plan.pristine.get(p)]
            lines.append(f"ok: apply would succeed ({patch_word(len(series.patches))}, "
                         f"{len(changed)} files change)")
        else:
            lines.append(f"ok: {plan.message}")
    return lines, error
