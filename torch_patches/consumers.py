"""The consumer series: torchtitan on the public FSDP2 lifecycle APIs.

``consumers/torchtitan/<version>/`` holds a patch series against the
torchtitan release on PyPI (``manifest.ini`` pins it, ``series`` lists
``NNNN-slug.patch`` files in ``git format-patch`` form). The pristine base is
the installed torchtitan itself; nothing of torchtitan is stored here.

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
import re
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .distinfo import metadata_headers
from .errors import PatchApplyError, TorchPatchesError
from .fsutil import resolve_python, write_files
from .patching import apply_patches
from .record import Record
from .series import Patch, read_patches

#: The repository's consumer series (present in a checkout, not in an installed package).
CONSUMERS_ROOT = Path(__file__).resolve().parent.parent / "consumers"
MARKER_NAME = "TORCH_PATCHES_CONSUMER.json"
FORMAT = 1

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
    version: str  # the pinned release
    revision: int
    repository: str  # upstream GitHub repository, for PR.md
    patches: Tuple[Patch, ...]
    packaged: Tuple[str, ...] = ()  # path prefixes an installed release has (default: package/)

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


def default_consumer_dir(name: str = "torchtitan") -> Path:
    """The newest series directory under ``consumers/<name>/`` of this checkout."""
    root = CONSUMERS_ROOT / name
    dirs = sorted((d for d in root.glob("*") if (d / "manifest.ini").is_file()), key=lambda d: d.name)
    if not dirs:
        raise TorchPatchesError(f"no consumer series under {root}; pass --series DIR "
                                "(consumers/ ships with a checkout of torch-fsdp-lifecycle)")
    return dirs[-1]


def load_consumer_series(directory: Optional[Path] = None) -> ConsumerSeries:
    directory = Path(directory) if directory is not None else default_consumer_dir()
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string((directory / "manifest.ini").read_text(encoding="utf-8"))
        base, series = parser["base"], parser["series"]
        distribution, version = base["distribution"], base["version"]
        revision = int(series["revision"])
    except (OSError, KeyError, ValueError, configparser.Error) as exc:
        raise TorchPatchesError(f"{directory}/manifest.ini: cannot read it ({exc})")
    packaged = tuple(base.get("packaged", "").split())
    return ConsumerSeries(directory, distribution, base.get("package", distribution), version, revision,
                          base.get("repository", ""), read_patches(directory), packaged)


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


def export(target: InstalledConsumer, output: Path, results: Optional[dict] = None) -> Path:
    """Write ``output``: the series' patches (``git format-patch`` files), ``series`` and ``PR.md``."""
    s = target.series
    marker = target.marker()
    pristine = (_pristine_from_marker(target, marker, "export") if marker is not None
                else _pristine_from_install(target))
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
        patches="\n".join(f"- `{p.name}`: {p.subject}" for p in s.patches),
        private_counts="| file | private FSDP references before | after |\n|---|---|---|\n" + "\n".join(counts),
        collective_table=collective_table(results),
        apply=f"git am {' '.join(p.name for p in s.patches)}",
    )
    (output / "PR.md").write_text(text, encoding="utf-8")
    return output


# -- command line (``torch-patches torchtitan ACTION``) ------------------------------------
def add_cli_arguments(p) -> None:
    p.add_argument("action", choices=("status", "apply", "revert", "export"), help="what to do (described above)")
    p.add_argument("--series", metavar="DIR", default=None,
                   help="consumer series directory (default: the newest under consumers/torchtitan/ "
                        "of this checkout)")
    p.add_argument("--python", metavar="PY", help="interpreter whose torchtitan to use, or a virtual "
                   "environment's directory (default: this one)")
    p.add_argument("-o", "--output", metavar="DIR", default="upstream-torchtitan",
                   help="export: output directory (default: upstream-torchtitan)")
    p.add_argument("--results", metavar="FILE", help="export: collective counts (JSON) for PR.md's table")


def run_cli(args) -> int:
    series = load_consumer_series(Path(args.series) if args.series else None)
    target = InstalledConsumer(series, args.python)
    if args.action == "status":
        print("\n".join(status(target)))
    elif args.action == "apply":
        print(apply(target))
    elif args.action == "revert":
        print(revert(target))
    else:
        results = None
        if args.results:
            try:
                results = json.loads(Path(args.results).read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise TorchPatchesError(f"cannot read --results {args.results}: {exc}")
        out = export(target, Path(args.output), results)
        print(f"export: {len(series.patches)} patch(es) and PR.md -> {out} "
              f"(apply in a {series.distribution} v{series.version} checkout with "
              f"`git am {out}/*.patch`)")
    return 0
