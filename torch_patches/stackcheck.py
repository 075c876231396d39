"""``export --check-stack``: does each PR of the stack pass its tests on its own?

Upstream CI tests a PR of a ghstack stack with only the PRs below it. For PR
k of the export's stack (:func:`~torch_patches.upstream.export.group_series`
order) the check:

1. copies a pristine torch venv with hard links (``cp -al``: seconds, and
   ``apply`` replaces files by rename, so the original is never written);
2. applies the series as far as PR k's last patch (:meth:`Series.upto`, the
   same all-or-nothing ``apply`` users run, with its marker);
3. runs PR k's test files (the ``[trackers]`` of the manifest) from the
   checkout with that venv's pytest, counting tests from its JUnit XML;
4. removes the copy.

The results are a :class:`StackCheck`, written as JSON (``--stack-results``)
with the command that made them, and shown in each PR's ``## Test Plan``.
A result recorded for other patch or test bytes than the export's is shown
as stale, never as a pass.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

from . import ops
from .errors import TorchPatchesError
from .fsutil import resolve_python
from .series import Series
from .targets.installed import InstalledTorch, run_locate
from .upstream.export import Group, check_out

#: Longest a PR's pytest run may take before it is stopped and counted as failed.
TIMEOUT = 3600
#: How many failing test ids a result keeps.
MAX_FAILING = 20
#: The results file in the export directory (``--stack-results`` names another).
RESULTS_NAME = "stack-check.json"
_VENV_INFO = ("import json, sys; print(json.dumps({'prefix': sys.prefix, 'base_prefix': sys.base_prefix, "
              "'pytest': __import__('importlib.util').util.find_spec('pytest') is not None}))")


@dataclass
class PRResult:
    """PR k's tests with patches 1..k applied."""

    key: str  # the PR's directory in the export: 203177, new-0001
    ref: str  # #203177, or the patch without a tracker
    patches: List[str]  # this PR's patches
    upto: int  # patches applied: 1..upto of the series
    tests: List[str]  # test files (repo paths) run
    digest: str = ""  # sha256 of patches 1..upto and the test files: what the result is about
    run: int = 0
    passed: int = 0
    failed: int = 0  # failures and errors
    skipped: int = 0
    seconds: float = 0.0
    returncode: Optional[int] = None  # None: nothing to run (no tests mapped)
    failing: List[str] = field(default_factory=list)  # test ids, at most MAX_FAILING
    note: str = ""
    recorded: str = ""  # when, and the command that checked it (a --recheck keeps the others')
    command: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode is None or (self.returncode == 0 and self.failed == 0 and self.skipped == 0)

    def summary(self) -> str:
        if self.returncode is None:
            return self.note or "no tests mapped to this PR"
        text = (f"{self.run} tests, {self.passed} passed, {self.failed} failed, {self.skipped} skipped "
                f"in {self.seconds:.1f} s")
        return text if self.ok else f"FAILED (pytest exit {self.returncode}): {text}"


@dataclass
class StackCheck:
    """Every PR's result, and how they were made."""

    command: str
    recorded: str
    base: str  # torch 2.15.0 (d0f2af8b66b2)
    revision: int
    prs: List[PRResult]

    @property
    def ok(self) -> bool:
        return all(pr.ok for pr in self.prs)

    def describe(self, path: os.PathLike) -> str:
        failed = [pr.ref for pr in self.prs if not pr.ok]
        return (f"stack check: {len(self.prs) - len(failed)} of {len(self.prs)} PR(s) pass on their own"
                + (f"; FAILED: {', '.join(failed)}" if failed else "") + f" -> {path}")

    def by_key(self) -> Dict[str, PRResult]:
        return {pr.key: pr for pr in self.prs}

    def write(self, path: os.PathLike) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: os.PathLike) -> "StackCheck":
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
            prs = [PRResult(**pr) for pr in raw.pop("prs")]
            return cls(prs=prs, **raw)
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise TorchPatchesError(f"cannot read stack check results {path}: {exc}")


# -- what a PR is ----------------------------------------------------------------------
def pr_plan(series: Series, groups: List[Group], repo: Path) -> List[PRResult]:
    """One empty :class:`PRResult` per PR: its patches, how far to apply, its test files."""
    index = {p.name: i for i, p in enumerate(series.patches)}
    plan = []
    for group in groups:
        upto = max(index[p.name] for p in group.patches) + 1
        tests = [rel for rel in group.tracker.tests if (repo / rel).is_file()]
        plan.append(PRResult(group.key, group.ref, [p.name for p in group.patches], upto, tests,
                             digest=digest(series, upto, repo, tests)))
    return plan


def digest(series: Series, upto: int, repo: Path, tests: List[str]) -> str:
    """What a result is about: the bytes of patches 1..upto and of the test files."""
    h = hashlib.sha256()
    for patch in series.patches[:upto]:
        h.update(patch.sha256.encode() + b"\0")
    for rel in tests:
        h.update(rel.encode() + b"\0" + hashlib.sha256((repo / rel).read_bytes()).hexdigest().encode())
    return h.hexdigest()


# -- the pristine venv -------------------------------------------------------------------
@dataclass(frozen=True)
class PristineVenv:
    """A virtual environment holding the unpatched base torch, and pytest."""

    root: Path  # sys.prefix: the directory copied for each PR
    python: Path  # its interpreter, inside root
    torch_dir: Path  # inside root


def pristine_venv(python: str, series: Series) -> PristineVenv:
    """Check that ``python`` is a venv's interpreter with the pristine base torch and pytest.

    Raises :class:`TorchPatchesError` naming what is wrong; reads only.
    """
    py = resolve_python(python)
    if os.sep in py and not Path(py).exists():
        raise TorchPatchesError(f"--check-stack {python}: no such interpreter or venv; give a venv "
                                f"with the pristine torch {series.base.version} (e.g. a copy of the test venv "
                                "reverted with `torch-patches revert --python COPY`)")
    target = InstalledTorch(py, run_locate(py))
    if target.kind == "wheel":
        raise TorchPatchesError(f"--check-stack {python}: its torch comes from a patched wheel; "
                                f"give a venv with the pristine torch {series.base.version}")
    problem = target.base_problem(series.base)
    if problem:
        raise TorchPatchesError(f"--check-stack {python}: {problem}", ops.REFUSED)
    marker = target.load_marker()
    if marker is not None:
        raise TorchPatchesError(f"--check-stack {python}: {marker.describe()} is applied to its torch; the check "
                                f"needs the pristine torch {series.base.version}: `torch-patches revert "
                                f"--python {python}` (or on a `cp -al` copy of that venv)")
    mismatched = target.verify_pristine(target.read_all(series.paths))
    if mismatched:
        raise TorchPatchesError(f"--check-stack {python}: its torch files are not the pristine base: "
                                + "; ".join(mismatched[:3]))
    proc = subprocess.run([py, "-c", _VENV_INFO], capture_output=True, text=True, cwd=tempfile.gettempdir())
    info = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {}
    root = Path(info.get("prefix", "/"))
    if not info or info["prefix"] == info["base_prefix"]:
        raise TorchPatchesError(f"--check-stack {python}: not a virtual environment; the check copies the venv "
                                "for each PR, so give a venv's interpreter or directory")
    if not info["pytest"]:
        raise TorchPatchesError(f"--check-stack {python}: pytest is not installed there "
                                "(`pip install -r tools/requirements-test.txt`)")
    try:
        target.torch_dir.relative_to(root)
        Path(py).relative_to(root)
    except ValueError:
        raise TorchPatchesError(f"--check-stack {python}: its torch ({target.torch_dir}) or interpreter is outside "
                                f"the venv {root}, so a copy of the venv would not hold them")
    return PristineVenv(root, Path(py), target.torch_dir)


def _copy(src: Path, dest: Path) -> None:
    """``cp -al``: a copy of ``src`` whose files are hard links (symlinks kept)."""
    if shutil.which("cp"):
        proc = subprocess.run(["cp", "-al", str(src), str(dest)], capture_output=True, text=True)
        if proc.returncode == 0:
            return
        shutil.rmtree(dest, ignore_errors=True)
        raise TorchPatchesError(f"cp -al {src} {dest} failed: {proc.stderr.strip()}")
    shutil.copytree(src, dest, symlinks=True, copy_function=os.link)


# -- running -----------------------------------------------------------------------------------
def _count(xml_path: Path, result: PRResult) -> None:
    """Fill the counts of ``result`` from pytest's JUnit XML."""
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError):
        return
    for case in root.iter("testcase"):
        result.run += 1
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), None)
        if outcome == "skipped":
            result.skipped += 1
        elif outcome is not None:
            result.failed += 1
            if len(result.failing) < MAX_FAILING:
                result.failing.append(f"{case.get('classname', '')}::{case.get('name', '')}")
        else:
            result.passed += 1


def _pytest(python: Path, tests: List[str], repo: Path, xml_path: Path, timeout: float) -> int:
    """Run pytest on ``tests`` from ``repo`` in its own process group; its exit status."""
    argv = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml_path}", *tests]
    with open(xml_path.with_suffix(".log"), "wb") as log:
        proc = subprocess.Popen(argv, cwd=repo, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return -signal.SIGKILL
        except BaseException:  # Ctrl-C: its own session would not see it; leave nothing running
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise


def check_pr(series: Series, venv: PristineVenv, result: PRResult, repo: Path, scratch: Path,
             timeout: float = TIMEOUT) -> PRResult:
    """Run ``result``'s tests on a copy of ``venv`` with patches 1..upto applied; fill it in."""
    if not result.tests:
        # Nothing to run; still prove the prefix applies (in memory, nothing written).
        ops.plan_apply(InstalledTorch(str(venv.python), run_locate(str(venv.python))), series.upto(result.upto))
        result.note = "no tests mapped to this PR in [trackers]; patches 1.." f"{result.upto} apply"
        return result
    copy = scratch / f"pr-{result.key}"
    try:
        _copy(venv.root, copy)
        python = copy / venv.python.relative_to(venv.root)
        ops.apply(InstalledTorch(str(python), run_locate(str(python))), series.upto(result.upto))
        xml_path = scratch / f"pr-{result.key}.xml"
        started = time.monotonic()
        result.returncode = _pytest(python, result.tests, repo, xml_path, timeout)
        result.seconds = round(time.monotonic() - started, 1)
        _count(xml_path, result)
        if result.returncode == -signal.SIGKILL:
            result.note = f"stopped after {timeout:.0f} s"
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    return result


def check_stack(series: Series, groups: List[Group], repo: Path, venv: PristineVenv, command: str,
                only: Optional[List[str]] = None, earlier: Optional[StackCheck] = None,
                timeout: float = TIMEOUT, progress: Callable[[str], None] = lambda _msg: None) -> StackCheck:
    """Check every PR of the stack in stack order, or only the PR keys in ``only``
    (the other PRs keep their results from ``earlier``, if it has them)."""
    plan = pr_plan(series, groups, repo)
    unknown = sorted(set(only or ()) - {pr.key for pr in plan})
    if unknown:
        raise TorchPatchesError(f"--recheck {','.join(unknown)}: no such PR in the stack; its PRs are "
                                + ", ".join(pr.key for pr in plan))
    todo = [pr for pr in plan if only is None or pr.key in only]
    recorded = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    # The copies go next to the venv: hard links need the same file system.
    with tempfile.TemporaryDirectory(prefix=f".{venv.root.name}-stack-", dir=venv.root.parent) as tmp:
        for n, pr in enumerate(todo, 1):
            what = f"{len(pr.tests)} test file(s)" if pr.tests else "no tests"
            progress(f"[{n}/{len(todo)}] {pr.key}: patches 1..{pr.upto} "
                     f"({series.patches[pr.upto - 1].name[:4]}), {what} ...")
            pr.recorded, pr.command = recorded, command
            check_pr(series, venv, pr, repo, Path(tmp), timeout)
            progress(f"[{n}/{len(todo)}] {pr.key}: {pr.summary()}")
            for test_id in pr.failing:
                progress(f"    failed: {test_id}")
    kept = earlier.by_key() if earlier is not None else {}
    for pr in kept.values():  # a kept result names the run that made it
        pr.recorded, pr.command = pr.recorded or earlier.recorded, pr.command or earlier.command
    prs = [pr if only is None or pr.key in only else kept[pr.key] for pr in plan
           if only is None or pr.key in only or pr.key in kept]
    return StackCheck(command, recorded, f"torch {series.base.version} ({series.base.git_version[:12]})",
                      series.revision, prs)


def test_plan_lines(pr: PRResult, check: StackCheck, current_digest: str) -> List[str]:
    """The ``## Test Plan`` paragraph of one PR."""
    if pr.digest != current_digest:
        return [f"**Stack check stale:** the result recorded {pr.recorded or check.recorded} was for other bytes of "
                "this PR's patches, the ones below it, or its test files; re-run "
                "`torch-patches export --check-stack VENV`.", ""]
    tests = " ".join(pr.tests)
    lines = [f"Stack check ({pr.recorded or check.recorded}): {check.base} with only this PR and the ones below it "
             f"(patches 1-{pr.upto} of series revision {check.revision}), "
             + (f"`pytest {tests}` from the torch-fsdp-lifecycle checkout: **{pr.summary()}**."
                if pr.tests else f"{pr.summary()}.")]
    lines += [f"Made by `{pr.command or check.command}`.", ""]
    if pr.failing:
        lines += ["Failing:", ""] + [f"- `{t}`" for t in pr.failing] + [""]
    return lines


def test_plans(check: StackCheck, series: Series, groups: List[Group], repo: Path) -> Dict[str, List[str]]:
    """Each checked PR's Test Plan paragraph, by PR key (for ``export(stack_lines=...)``)."""
    recorded = check.by_key()
    out = {}
    for current in pr_plan(series, groups, repo):
        pr = recorded.get(current.key)
        if pr is not None:
            out[current.key] = test_plan_lines(pr, check, current.digest)
    return out


def for_export(series: Series, groups: List[Group], repo: Path, out: os.PathLike, check_venv: Optional[str],
               results_file: Optional[os.PathLike], command: str, recheck: Optional[List[str]] = None,
               progress: Callable[[str], None] = lambda _msg: None) -> Optional[StackCheck]:
    """What ``export`` shows in the Test Plans: a new check with the pristine venv
    ``check_venv`` (its inputs and ``out`` checked first, so that bad input
    changes nothing; with ``recheck``, only those PRs, the others' results kept
    from ``results_file``), else the results in ``results_file``, else nothing."""
    if recheck and not check_venv:
        raise TorchPatchesError("--recheck needs --check-stack VENV")
    if check_venv:
        venv = pristine_venv(check_venv, series)
        check_out(out)
        kept = Path(results_file or Path(out) / RESULTS_NAME)
        earlier = StackCheck.load(kept) if recheck and kept.is_file() else None
        return check_stack(series, groups, repo, venv, command, only=recheck, earlier=earlier, progress=progress)
    return StackCheck.load(results_file) if results_file else None
