"""The consumer series: torchtitan on the public FSDP2 lifecycle APIs.

``consumers/torchtitan/<version>/`` holds a patch series against the
torchtitan release on PyPI (``manifest.ini`` pins it, ``series`` lists
``NNNN-slug.patch`` files in ``git format-patch`` form). The pristine base is
the installed torchtitan itself; nothing of torchtitan is stored here.

``consumers/torchtitan/main-<sha>/`` is the same change written against a
commit of torchtitan's main branch (``[base] commit``), where its pull request
goes. No wheel holds that commit: its files come from torchtitan's sources
(``--source DIR`` or ``$TORCHTITAN_SOURCE``: a git directory, bare or a
checkout's, read at the commit, or a plain directory whose files must be the
blobs the patches' ``index`` lines name). ``export`` writes its PR from there;
``status`` checks it against another revision of main (``--onto REV``, default
the source's ``HEAD``): *current* (the files are the blobs the series was
written against), *moved* (they changed; the patches still apply, or they
conflict: refresh the series, see docs/consumers.md) or *merged* (every patch
reverse-applies).
``apply``/``revert`` take only a release series: they patch an installed
release.

``torch-patches torchtitan apply|revert|status|export`` give it the torch
series' guarantees, with the same machinery (:mod:`.patching`'s strict
applier, :mod:`.fsutil`'s all-or-nothing replacement, :class:`.record.Record`
for the dist-info RECORD):

* pinned base: the installed distribution's version must be the manifest's,
  and every file the series touches must hash as its RECORD row says (the
  released bytes);
* all or nothing: the patched files, RECORD and the marker are swapped in by
  one :func:`.fsutil.write_files` call, after every hunk applied in memory;
* exact revert: the marker (``<dist-info>/TORCH_PATCHES_CONSUMER.json``) keeps
  the pristine bytes and RECORD's undo log; revert refuses if a patched file
  changed since;
* idempotent: applying the applied series changes nothing; applying another
  revision switches from the marker's pristine bytes.

The installed release holds only its packages: hunks for other paths (the
PR's ``tests/``) are skipped by apply, revert and status, as the torch
series skips ``docs/`` for an installed torch, and ``export`` writes them
into the PR unchanged. ``[base] packaged`` lists the prefixes an installed
release has (default: ``<package>/``).
"""

from __future__ import annotations

import configparser
import hashlib
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .distinfo import metadata_headers
from .errors import PatchApplyError, TorchPatchesError
from .fsutil import resolve_python, write_files
from .patching import FilePatch, apply_patches
from .record import Record
from .series import Patch, read_patches
from .state import base_blob_mismatches, retired_reason

#: The repository's consumer series (present in a checkout, not in an installed package).
CONSUMERS_ROOT = Path(__file__).resolve().parent.parent / "consumers"
MARKER_NAME = "TORCH_PATCHES_CONSUMER.json"
FORMAT = 1
#: Where a main-branch series finds torchtitan's sources when ``--source`` is not given.
SOURCE_ENV = "TORCHTITAN_SOURCE"
#: ``git am`` strips every leading ``[...]`` of a subject by default; torchtitan's titles
#: keep their ``[loss]`` prefix, so only the ``[PATCH]`` bracket may go.
GIT_AM_OPTIONS = "--keep-non-patch"

#: Private FSDP names a consumer of the public API must not reference.
PRIVATE_FSDP_NAMES = (
    "_get_fsdp_state", "_fsdp_param_group", "_state_ctx", "_post_forward",
    "_modules_to_run_forward", "_lazy_init", "_comm_ctx", "_fully_shard",
)
_PRIVATE_RE = re.compile("|".join(re.escape(n) for n in PRIVATE_FSDP_NAMES))


def private_references(data: bytes) -> Dict[str, int]:
    """How often each of :data:`PRIVATE_FSDP_NAMES` occurs in ``data`` (``_fsdp_param_group``
    also counts ``_fsdp_param_groups``)."""
    text = data.decode("utf-8", "replace")
    counts = {name: 0 for name in PRIVATE_FSDP_NAMES}
    for m in _PRIVATE_RE.finditer(text):
        counts[m.group(0)] += 1
    return counts


# -- the series -------------------------------------------------------------------------
@dataclass(frozen=True)
class ConsumerSeries:
    directory: Path
    distribution: str  # the PyPI name, e.g. torchtitan
    package: str  # the import name
    version: str  # the pinned release ("" for a series against a commit of a branch)
    revision: int
    repository: str  # upstream GitHub repository, for PR.md
    patches: Tuple[Patch, ...]
    packaged: Tuple[str, ...] = ()  # path prefixes an installed release has (default: package/)
    commit: str = ""  # the full commit id a branch series is written against
    branch: str = ""  # that commit's branch (main)

    @property
    def name(self) -> str:
        """The ``--target`` name: the directory's (``0.3.0``, ``main-b5bcd76c6``)."""
        return self.directory.name

    @property
    def base_label(self) -> str:
        """What the series applies to, for messages and PR.md."""
        return f"v{self.version}" if self.version else f"{self.branch} at {self.commit[:9]}"

    @property
    def file_patches(self) -> List[FilePatch]:
        return [fp for patch in self.patches for fp in patch.files]

    def is_packaged(self, path: str) -> bool:
        return any(path.startswith(prefix) for prefix in (self.packaged or (self.package + "/",)))

    @property
    def paths(self) -> List[str]:
        seen: Dict[str, None] = {}
        for patch in self.patches:
            for fp in patch.files:
                seen.setdefault(fp.path, None)
        return list(seen)

    def held(self) -> Tuple["ConsumerSeries", List[str]]:
        """This series without the file diffs an installed release cannot hold (the PR's ``tests/``),
        and those paths, as :func:`.ops.held_series` does for the torch series' ``docs/``. Patch
        names and bytes (so :meth:`identity` and the exported files) are unchanged."""
        skipped = [p for p in self.paths if not self.is_packaged(p)]
        if not skipped:
            return self, []
        return replace(self, patches=tuple(p.restricted(self.is_packaged) for p in self.patches)), skipped

    def identity(self) -> dict:
        return {"revision": self.revision,
                "patches": [{"name": p.name, "sha256": p.sha256} for p in self.patches]}


def consumer_dirs(name: str = "torchtitan") -> List[Path]:
    """The series directories under ``consumers/<name>/`` of this checkout, by name."""
    root = CONSUMERS_ROOT / name
    dirs = sorted((d for d in root.glob("*") if (d / "manifest.ini").is_file()), key=lambda d: d.name)
    if not dirs:
        raise TorchPatchesError(f"no consumer series under {root}; pass --series DIR "
                                "(consumers/ ships with a checkout of torch-fsdp-lifecycle)")
    return dirs


def default_consumer_dir(name: str = "torchtitan") -> Path:
    """The newest *release* series under ``consumers/<name>/`` (the one an installed release takes);
    a series against a branch commit (``main-<sha>``) is only chosen by ``--target``."""
    releases = [d for d in consumer_dirs(name) if not load_consumer_series(d).commit]
    if not releases:
        raise TorchPatchesError(f"no release series under {CONSUMERS_ROOT / name}; pass --target or --series")
    return max(releases, key=lambda d: tuple(int(x) if x.isdigit() else -1 for x in d.name.split(".")))


def consumer_dir(target: str, name: str = "torchtitan") -> Path:
    """``consumers/<name>/<target>/``; the error lists the targets there are."""
    dirs = consumer_dirs(name)
    for d in dirs:
        if d.name == target:
            return d
    raise TorchPatchesError(f"no consumer series {target!r} under {CONSUMERS_ROOT / name}; targets: "
                            + ", ".join(d.name for d in dirs))


def load_consumer_series(directory: Optional[Path] = None) -> ConsumerSeries:
    directory = Path(directory) if directory is not None else default_consumer_dir()
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string((directory / "manifest.ini").read_text(encoding="utf-8"))
        base, series = parser["base"], parser["series"]
        distribution = base["distribution"]
        version, commit = base.get("version", "").strip(), base.get("commit", "").strip()
        if bool(version) == bool(commit):
            raise ValueError("[base] needs exactly one of version (a release) and commit (a branch's commit)")
        if commit and not re.fullmatch(r"[0-9a-f]{40}", commit):
            raise ValueError(f"[base] commit must be a full 40-digit commit id, not {commit!r}")
        revision = int(series["revision"])
    except (OSError, KeyError, ValueError, configparser.Error) as exc:
        raise TorchPatchesError(f"{directory}/manifest.ini: cannot read it ({exc})")
    packaged = tuple(base.get("packaged", "").split())
    return ConsumerSeries(directory, distribution, base.get("package", distribution), version, revision,
                          base.get("repository", ""), read_patches(directory), packaged,
                          commit=commit, branch=base.get("branch", "main").strip() if commit else "")


# -- the installed distribution ------------------------------------------------------
_LOCATE = r"""
import importlib.util, json, os, sys
sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]
spec = importlib.util.find_spec(sys.argv[1])
loc = list(spec.submodule_search_locations or []) if spec else []
print(json.dumps({"executable": sys.executable, "package_dir": loc[0] if loc else None}))
"""


class InstalledConsumer:
    """An installed distribution (its package directory's parent and its dist-info)."""

    def __init__(self, series: ConsumerSeries, python: Optional[str] = None):
        import sys
        if series.commit:
            raise TorchPatchesError(
                f"{series.name} is written against {series.distribution} {series.base_label}, not a "
                f"release; an installed {series.distribution} is a release, so apply, revert and status of "
                f"an install take a release series (--target {default_consumer_dir().name}, the default). "
                f"This one's PR: `torchtitan export --target {series.name} --source DIR`", exit_code=3)
        python = resolve_python(python or sys.executable)
        try:
            proc = subprocess.run([python, "-c", _LOCATE, series.package], capture_output=True, text=True,
                                  cwd=tempfile.gettempdir(), timeout=120)
        except OSError as exc:
            raise TorchPatchesError(f"cannot run {python}: {exc.strerror}")
        if proc.returncode != 0:
            raise TorchPatchesError(f"could not run {python}: {proc.stderr.strip()[-500:]}")
        info = json.loads(proc.stdout.strip().splitlines()[-1])
        if not info["package_dir"]:
            raise TorchPatchesError(f"{python} has no {series.distribution} installed; install it with "
                                    f"`pip install --no-deps {series.distribution}=={series.version}`")
        self.executable = info["executable"]
        self.package_dir = Path(info["package_dir"])
        self.root = self.package_dir.parent
        found = []
        for d in sorted(self.root.glob(f"{series.distribution}-*.dist-info")):
            try:
                meta = metadata_headers((d / "METADATA").read_bytes())
            except OSError:
                continue
            if meta.get("name", "").lower().replace("_", "-") == series.distribution.lower():
                found.append((d, meta.get("version", "")))
        if len(found) != 1:
            raise TorchPatchesError(f"{self.root}: expected one {series.distribution}-*.dist-info, found "
                                    f"{len(found)}; reinstall {series.distribution}=={series.version}")
        self.dist_info, self.version = found[0]
        # Only the file diffs an installed release can hold; ``skipped``: the other paths
        self.series, self.skipped = series.held()

    @property
    def marker_rel(self) -> str:
        return f"{self.dist_info.name}/{MARKER_NAME}"

    @property
    def record_rel(self) -> str:
        return f"{self.dist_info.name}/RECORD"

    def read(self, rel: str) -> Optional[bytes]:
        try:
            return (self.root / rel).read_bytes()
        except FileNotFoundError:
            return None

    def marker(self) -> Optional[dict]:
        data = self.read(self.marker_rel)
        if data is None:
            return None
        try:
            marker = json.loads(data)
        except ValueError:
            raise TorchPatchesError(f"{self.root / self.marker_rel} is corrupt; reinstall "
                                    f"{self.series.distribution}=={self.series.version}")
        if marker.get("format") != FORMAT:
            raise TorchPatchesError(f"{self.root / self.marker_rel}: unknown format {marker.get('format')}")
        return marker


def _sha(data: Optional[bytes]) -> Optional[str]:
    return None if data is None else hashlib.sha256(data).hexdigest()


def _record(target: InstalledConsumer) -> Record:
    # Bytes, not text mode: pip writes RECORD with \r\n, which must survive byte for byte
    return Record((target.root / target.record_rel).read_bytes().decode("utf-8"))


def _base_problem(target: InstalledConsumer) -> Optional[str]:
    s = target.series
    if target.version != s.version:
        return (f"{s.distribution} {target.version} is installed, but the series is pinned to "
                f"{s.version}; install it with `pip install --no-deps {s.distribution}=={s.version}`")
    return None


def _pristine_from_install(target: InstalledConsumer) -> Dict[str, Optional[bytes]]:
    """The series' files as installed, checked against RECORD (the released bytes)."""
    record = _record(target)
    files: Dict[str, Optional[bytes]] = {}
    changed = []
    for rel in target.series.paths:
        data = target.read(rel)
        if data is not None and record.verify([rel], lambda _p, d=data: d):
            changed.append(rel)
        files[rel] = data
    if changed:
        raise TorchPatchesError(
            "these files differ from the installed release (RECORD), nothing was changed:\n  "
            + "\n  ".join(changed) + f"\nReinstall {target.series.distribution}=={target.series.version} "
            "(pip install --force-reinstall --no-deps) and try again")
    return files


def _pristine_from_marker(target: InstalledConsumer, marker: dict, what: str) -> Dict[str, Optional[bytes]]:
    """The marker's pristine bytes; refuses if a patched file changed since apply."""
    changed = [rel for rel, entry in marker["files"].items() if _sha(target.read(rel)) != entry["patched_sha256"]]
    if changed:
        raise TorchPatchesError(
            f"cannot {what}: these patched files changed since apply, nothing was changed:\n  "
            + "\n  ".join(changed) + f"\nReinstall {target.series.distribution}=={target.series.version}.")
    return {rel: (None if entry["pristine"] is None else entry["pristine"].encode("utf-8"))
            for rel, entry in marker["files"].items()}


def _undo_changes(target: InstalledConsumer, marker: dict, pristine: Dict[str, Optional[bytes]]):
    record = _record(target)
    record.undo(marker["record_undo"])
    changes: Dict[str, Optional[bytes]] = dict(pristine)
    changes[target.marker_rel] = None
    changes[target.record_rel] = record.text().encode("utf-8")
    return changes


def apply(target: InstalledConsumer) -> str:
    s = target.series
    problem = _base_problem(target)
    if problem:
        raise TorchPatchesError(problem, exit_code=3)
    marker = target.marker()
    if marker is not None:
        if marker["series"] == s.identity():
            _pristine_from_marker(target, marker, "check the applied series")
            return f"{s.distribution} {target.version}: consumer series revision {s.revision} is already applied"
        old = _pristine_from_marker(target, marker, "switch series")
        record = _record(target)
        record.undo(marker["record_undo"])
        pristine = {rel: old[rel] if rel in old else target.read(rel) for rel in s.paths}
        # Files only the applied revision touched go back to their pristine bytes
        restore = {rel: data for rel, data in old.items() if rel not in pristine}
    else:
        pristine = _pristine_from_install(target)
        record = _record(target)
        restore = {}
    patched = pristine
    for patch in s.patches:
        try:
            patched = apply_patches(patched, list(patch.files), where=patch.name)
        except PatchApplyError as exc:
            raise TorchPatchesError(f"{exc}; nothing was changed")
    new_marker = {
        "format": FORMAT, "distribution": s.distribution, "base_version": s.version,
        "series": s.identity(),
        "files": {rel: {"pristine": None if pristine[rel] is None else pristine[rel].decode("utf-8"),
                        "pristine_sha256": _sha(pristine[rel]), "patched_sha256": _sha(patched[rel])}
                  for rel in s.paths},
    }
    changes: Dict[str, Optional[bytes]] = {rel: patched[rel] for rel in s.paths}
    undo = record.update(changes)
    # The marker is listed in RECORD without a hash (it holds RECORD's undo log)
    record.lines.append(record.line_for(target.marker_rel, None))
    record._reindex()
    undo[target.marker_rel] = [None, None]
    new_marker["record_undo"] = undo
    changes[target.marker_rel] = (json.dumps(new_marker, indent=1, sort_keys=True) + "\n").encode("utf-8")
    changes[target.record_rel] = record.text().encode("utf-8")
    changes.update(restore)
    write_files(target.root, changes)
    verb = "switched to" if marker is not None else "applied"
    return (f"{s.distribution} {target.version}: {verb} consumer series revision {s.revision} "
            f"({len(s.patches)} patch(es), {len(s.paths)} file(s)) at {target.root}"
            + "".join(f"\nskipped {rel}: not part of an installed {s.distribution} (export includes it)"
                      for rel in target.skipped))


def revert(target: InstalledConsumer) -> str:
    s = target.series
    marker = target.marker()
    if marker is None:
        return f"{s.distribution} {target.version}: no consumer series applied, nothing to revert"
    pristine = _pristine_from_marker(target, marker, "revert")
    write_files(target.root, _undo_changes(target, marker, pristine))
    return f"{s.distribution} {target.version}: reverted consumer series revision {marker['series']['revision']}"


def status(target: InstalledConsumer) -> List[str]:
    s = target.series
    lines = [f"python:      {target.executable}",
             f"{s.distribution}: {target.version} at {target.package_dir}",
             f"series:      {s.directory} (pinned {s.distribution} {s.version}, revision {s.revision})"]
    problem = _base_problem(target)
    marker = target.marker()
    if marker is None:
        state = "not applied" + (f" ({problem})" if problem else "")
    elif marker["series"] == s.identity():
        changed = [rel for rel, e in marker["files"].items() if _sha(target.read(rel)) != e["patched_sha256"]]
        state = "applied" if not changed else "applied, but changed since: " + ", ".join(changed)
    else:
        state = f"another revision applied ({marker['series']['revision']}); `apply` switches"
    lines.append(f"state:       {state}")
    for rel in s.paths:
        refs = sum(private_references(target.read(rel) or b"").values())
        lines.append(f"  {rel}: {refs} private FSDP reference(s)")
    for rel in target.skipped:
        lines.append(f"note:        {rel} is not part of an installed {s.distribution}: skipped here "
                     "(export includes it)")
    return lines


# -- export ---------------------------------------------------------------------------------
def collective_table(results: Optional[dict]) -> str:
    """PR.md's before/after table from ``tools/bench/torchtitan_chunked.py``'s result file
    (also rendered into docs/benchmarks.md)."""
    if not results:
        return ("(not measured: pass `--results FILE`, written by "
                "`python tools/bench/torchtitan_chunked.py`)\n")
    rows = ["| scenario | wrapper | reduce-scatter / step | per microbatch | head's reduce-scatter "
            "(index in the step) | all-gather / step | caller policy | max abs grad diff vs reference | "
            "step time vs 0.3.0 |",
            "|---|---|---|---|---|---|---|---|---|"]

    def cell(value, fmt="{}"):
        return "-" if value is None else fmt.format(value)

    for r in results["rows"]:
        rows.append(" | ".join([
            f"| {r['scenario']}", r["wrapper"], cell(r.get("reduce_scatter")),
            cell(r.get("reduce_scatter_per_microbatch")), cell(r.get("head_reduce_scatter_positions")),
            cell(r.get("all_gather")), "kept" if r.get("policy_kept") else "overwritten",
            cell(r.get("max_grad_diff"), "{:.2e}"), cell(r.get("step_time_ratio_vs_0.3.0"), "x{:.2f}"),
        ]) + " |")
    note = results.get("note", "")
    meta, params = results.get("meta"), results.get("params", {})
    if meta:
        note += (f" Measured {meta['date']} at commit `{meta['commit']}`, torch {meta['torch']} with the "
                 f"lifecycle series ({params.get('torch_series', meta['series'])}), consumer series revision "
                 f"{params.get('consumer_series_revision', '?')}, load average {meta['load_before']:.1f} "
                 f"before / {meta['load_after']:.1f} after: `{params.get('command', '')}`.")
    return "\n".join(rows) + "\n" + (f"\n{note.strip()}\n" if note else "")


def _write_export(s: ConsumerSeries, pristine: Dict[str, Optional[bytes]], output: Path,
                  results: Optional[dict]) -> Path:
    """Write ``output``: the series' patches (``git format-patch`` files), ``series`` and ``PR.md``,
    whose private-reference counts compare ``pristine`` with the series applied to it."""
    patched = pristine
    for patch in s.patches:
        patched = apply_patches(patched, list(patch.files), where=patch.name)
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    for patch in s.patches:
        (output / patch.name).write_bytes(patch.data)
    (output / "series").write_text("".join(p.name + "\n" for p in s.patches), encoding="utf-8")
    template = (s.directory / "PR.md.in").read_text(encoding="utf-8")
    counts = []
    for rel in s.paths:
        before = sum(private_references(pristine[rel] or b"").values())
        after = sum(private_references(patched[rel] or b"").values())
        counts.append(f"| `{rel}` | {before} | {after} |")
    text = template.format(
        distribution=s.distribution, version=s.version, revision=s.revision, repository=s.repository,
        commit=s.commit, short_commit=s.commit[:9], branch=s.branch, base=s.base_label,
        patches="\n".join(f"- `{p.name}`: {p.subject}" for p in s.patches),
        private_counts="| file | private FSDP references before | after |\n|---|---|---|\n" + "\n".join(counts),
        collective_table=collective_table(results),
        apply=f"git am {GIT_AM_OPTIONS} {' '.join(p.name for p in s.patches)}",
    )
    (output / "PR.md").write_text(text, encoding="utf-8")
    return output


def export(target: InstalledConsumer, output: Path, results: Optional[dict] = None) -> Path:
    """Write ``output`` for a release series, from the installed release's pristine files."""
    marker = target.marker()
    pristine = (_pristine_from_marker(target, marker, "export") if marker is not None
                else _pristine_from_install(target))
    return _write_export(target.series, pristine, output, results)


# -- a series against a branch commit: torchtitan's sources ---------------------------
def _git(directory: Path, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", "-C", str(directory), *args], capture_output=True, timeout=300)
    except OSError as exc:
        raise TorchPatchesError(f"cannot run git: {exc.strerror}")


class SourceTree:
    """torchtitan's sources: a git directory (bare, or a checkout's), read at a revision with
    ``git cat-file``, or a plain directory (an archive's extraction), read from disk."""

    def __init__(self, path: Optional[str]):
        if not path:
            raise TorchPatchesError(
                f"this series is written against a commit of torchtitan, not a release: pass --source DIR "
                f"or set {SOURCE_ENV} (a torchtitan git checkout, a bare clone, or the commit's files)")
        self.path = Path(path).resolve()
        if not self.path.is_dir():
            raise TorchPatchesError(f"--source {path}: not a directory")
        proc = _git(self.path, "rev-parse", "--absolute-git-dir")
        git_dir = Path(proc.stdout.decode().strip()) if proc.returncode == 0 else None
        # A plain directory inside some other repository's work tree is not that repository
        self.is_git = git_dir is not None and git_dir.resolve() in (self.path, self.path / ".git")

    def resolve(self, rev: str) -> str:
        """The full commit id of ``rev``."""
        proc = _git(self.path, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
        if proc.returncode != 0:
            raise TorchPatchesError(f"{self.path} has no commit {rev!r}; fetch torchtitan's main branch there "
                                    "(e.g. `git fetch origin main`) and try again")
        return proc.stdout.decode().strip()

    def files(self, paths: List[str], rev: Optional[str]) -> Dict[str, Optional[bytes]]:
        """``paths`` at ``rev`` (a git source) or on disk (a plain directory: ``rev`` is None)."""
        out: Dict[str, Optional[bytes]] = {}
        for rel in paths:
            if rev is None:
                p = self.path / rel
                out[rel] = p.read_bytes() if p.is_file() else None
            else:
                proc = _git(self.path, "cat-file", "blob", f"{rev}:{rel}")
                out[rel] = proc.stdout if proc.returncode == 0 else None
        return out

    def log(self, since: str, rev: str, paths: List[str]) -> List[str]:
        """``git log --oneline since..rev -- paths`` (empty if ``since`` is unknown here)."""
        proc = _git(self.path, "log", "--oneline", "--no-decorate", f"{since}..{rev}", "--", *paths)
        return proc.stdout.decode("utf-8", "replace").splitlines() if proc.returncode == 0 else []


def _base_files(s: ConsumerSeries, source: SourceTree) -> Dict[str, Optional[bytes]]:
    """The files the series was written against: at its commit, or a plain directory's after checking
    their blob ids against the patches' ``index`` lines."""
    files = source.files(s.paths, source.resolve(s.commit) if source.is_git else None)
    problems = [f"{rel} is missing" for rel, data in files.items() if data is None]
    problems += base_blob_mismatches(s, files)  # type: ignore[arg-type]  # duck-typed: file_patches
    if problems:
        raise TorchPatchesError(f"{source.path} is not {s.distribution} {s.base_label}, nothing was written:\n  "
                                + "\n  ".join(problems) + "\nPass a git directory that has the commit, or "
                                "its files (`git archive`)")
    return files


def export_from_source(s: ConsumerSeries, source: SourceTree, output: Path,
                       results: Optional[dict] = None) -> Path:
    """Write ``output`` for a branch series, from torchtitan's files at the series' commit."""
    return _write_export(s, _base_files(s, source), output, results)


def check_source(s: ConsumerSeries, source: SourceTree, onto: Optional[str] = None) -> Tuple[List[str], bool]:
    """Has the branch moved? The series against ``onto`` (a revision of a git source, default
    ``HEAD``; a plain directory's files as they are): report lines, and whether every patch applies
    (with the strict applier: hunks may have moved, their lines may not have changed)."""
    if not source.is_git and onto:
        raise TorchPatchesError(f"--onto {onto}: {source.path} is not a git directory (a plain directory "
                                "is checked as it is)")
    rev = source.resolve(onto or "HEAD") if source.is_git else None
    where = " (files on disk)"
    if rev is not None:
        where = f" at {rev[:9]}" + ("" if onto and rev.startswith(onto) else f" ({onto or 'HEAD'})")
    lines = [f"series:      {s.directory} ({s.distribution} {s.base_label}, revision {s.revision})",
             f"source:      {source.path}{where}"]
    files = source.files(s.paths, rev)
    mismatched = {line.split(" ", 1)[0] for line in base_blob_mismatches(s, files)}  # type: ignore[arg-type]
    for rel in s.paths:
        state = ("missing" if files[rel] is None else
                 f"changed since {s.commit[:9]}" if rel in mismatched else f"as at {s.commit[:9]}")
        lines.append(f"  {rel}: {state}")
    if rev and mismatched:
        lines += [f"  touched by {c}" for c in source.log(s.commit, rev, sorted(mismatched))]
    moved = bool(mismatched) or any(data is None for data in files.values())
    verdicts = []
    for patch in s.patches:  # in order, each on the files the ones before it made
        retired = retired_reason(patch, files)
        try:
            files, verdict = apply_patches(files, list(patch.files), where=patch.name), "applies"
        except PatchApplyError as exc:
            verdict = "already in tree" if retired else "conflicts"
            retired = retired or str(exc).replace(f"{patch.name}: ", "", 1)
        verdicts.append(verdict)
        lines.append(f"  {verdict:<16} {patch.name}" + (f"\n  {'':<16}   {retired}" if retired else ""))
    ok = "conflicts" not in verdicts
    if not moved:
        state = "current: the files are the ones the series was written against"
    elif set(verdicts) == {"already in tree"}:
        state = f"merged: {s.branch} already has every patch of the series; retire it"
    elif ok:
        state = (f"moved: {s.branch} changed the files since {s.commit[:9]}, the patches still apply; "
                 "refresh the series (docs/consumers.md) before the PR")
    else:
        state = (f"moved: {s.branch} changed the files since {s.commit[:9]} and the series CONFLICTS; "
                 "refresh it (docs/consumers.md)")
    lines.append(f"state:       {state}")
    return lines, ok


# -- command line (``torch-patches torchtitan ACTION``) ------------------------------------
def add_cli_arguments(p) -> None:
    p.add_argument("action", choices=("status", "apply", "revert", "export"), help="what to do (described above)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--target", metavar="NAME",
                       help="series under consumers/torchtitan/ of this checkout: a release (0.3.0, the default "
                            "for an installed torchtitan) or main-<commit> (export/status with --source)")
    which.add_argument("--series", metavar="DIR", default=None, help="consumer series directory")
    p.add_argument("--python", metavar="PY", help="interpreter whose torchtitan to use, or a virtual "
                   "environment's directory (default: this one)")
    p.add_argument("-o", "--output", metavar="DIR", default="upstream-torchtitan",
                   help="export: output directory (default: upstream-torchtitan)")
    p.add_argument("--results", metavar="FILE", help="export: collective counts (JSON) for PR.md's table")
    p.add_argument("--source", metavar="DIR", default=None,
                   help=f"main-<commit> series: torchtitan's sources, a git directory or the commit's files "
                        f"(default: ${SOURCE_ENV})")
    p.add_argument("--onto", metavar="REV", help="main-<commit> series: status checks the series against this "
                   "revision of the --source git directory (default: HEAD); export checks its output there")


def _results(path: Optional[str]) -> Optional[dict]:
    if not path:
        return None
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TorchPatchesError(f"cannot read --results {path}: {exc}")


def _run_branch_series(series: ConsumerSeries, args) -> int:
    if args.action in ("apply", "revert"):
        InstalledConsumer(series)  # raises: an installed torchtitan is a release
    source = SourceTree(args.source or os.environ.get(SOURCE_ENV))
    if args.action == "export":
        out = export_from_source(series, source, Path(args.output), _results(args.results))
        print(f"export: {len(series.patches)} patch(es) and PR.md -> {out} (checked against {series.distribution} "
              f"{series.base_label}; apply in a checkout of that commit with `git am {GIT_AM_OPTIONS} {out}/*.patch`)")
        if not args.onto:
            return 0
    lines, ok = check_source(series, source, args.onto)
    print("\n".join(lines))
    return 0 if ok else 1


def run_cli(args) -> int:
    if args.series:
        series = load_consumer_series(Path(args.series))
    else:
        series = load_consumer_series(consumer_dir(args.target) if args.target else None)
    if series.commit:
        return _run_branch_series(series, args)
    if args.source or args.onto:
        raise TorchPatchesError(f"--source and --onto are for a series against a torchtitan commit "
                                f"(--target main-<commit>); {series.name} patches the installed release")
    target = InstalledConsumer(series, args.python)
    if args.action == "status":
        print("\n".join(status(target)))
    elif args.action == "apply":
        print(apply(target))
    elif args.action == "revert":
        print(revert(target))
    else:
        out = export(target, Path(args.output), _results(args.results))
        print(f"export: {len(series.patches)} patch(es) and PR.md -> {out} "
              f"(apply in a {series.distribution} v{series.version} checkout with "
              f"`git am {GIT_AM_OPTIONS} {out}/*.patch`)")
    return 0
