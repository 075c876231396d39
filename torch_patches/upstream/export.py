"""``export``: the series as pytorch/pytorch pull requests, one per upstream tracker.

Every patch names its upstream issue in its DEP-3 ``Bug:`` field; patches with
the same issue form one PR. For each tracker ``N`` the export writes ``DIR/N/``:

* ``NNNN-*.patch``: a ``git format-patch`` series with the tracker's source
  patch(es) and one commit adding its tests at their upstream paths (the
  ``[trackers]`` of the series' ``manifest.ini``); the shared test helper becomes
  ``torch/testing/_internal/common_fsdp_lifecycle.py`` and the tests import it
  from there instead of through ``sys.path``;
* ``PR.md``: the PR description in upstream's form: title, ``Fixes #N``,
  ``## Summary`` (commit messages, base, stack order, new public API with its
  docstrings) and ``## Test Plan`` (the commands, and their output only when
  it was recorded: see :func:`load_results`);
* docs: a tracker with entries in the series' ``docs/<key>.md`` (see
  :mod:`torch_patches.upstream.docs`) gets one more commit that inserts them
  into the ``[docs] file`` (``docs/source/distributed.fsdp.fully_shard.md``)
  when the base content of that file is available (``--source DIR``);
  otherwise they are written to ``DIR/N/DOCS.md`` and ``PR.md`` says so.

The PRs form a stack in series order (ghstack-style): ``DIR/series`` lists
every patch in ``git am`` order, and each PR applies on top of the ones before
it (``#203176`` and ``#203178`` build on ``#203177``).

The stack is built with real git in a scratch repository: the pristine base
files (the same ones ``tools/devtree.py init`` uses), ``git am`` of the series,
one test commit (and one docs commit) per tracker, then ``git format-patch``
per tracker.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from ..errors import TorchPatchesError
from ..files import Files
from ..fsutil import resolve_python
from ..series import NESTED_PATCH_NAME, DocsEntry, Patch, Series, Tracker, read_docs_entries, read_series_file
from . import docs as docs_mod
from . import gitstack
from .gitstack import git

ISSUE_URL = "https://github.com/pytorch/pytorch/issues/"
_BUG_RE = re.compile(r"github\.com/pytorch/pytorch/(?:issues|pull)/(\d+)")


#: The tests' shared helper: here, and where it lives upstream.
HELPER = "test/distributed/fsdp_lifecycle_testing.py"
HELPER_MODULE = "fsdp_lifecycle_testing"
HELPER_UPSTREAM = "torch/testing/_internal/common_fsdp_lifecycle.py"
HELPER_UPSTREAM_MODULE = "torch.testing._internal.common_fsdp_lifecycle"

_EXPORT_HEADER = "# torch-patches export:"
#: A PR directory's docs entries when they are not committed (no ``--source``).
DOCS_NAME = "DOCS.md"


@dataclass
class Group:
    """The patches of one tracker, and what the export found for it."""

    tracker: Tracker
    patches: List[Patch] = field(default_factory=list)
    tests: Dict[str, bytes] = field(default_factory=dict)  # upstream path -> content
    missing_tests: List[str] = field(default_factory=list)
    api: List["ApiEntry"] = field(default_factory=list)
    files: List[str] = field(default_factory=list)  # written patch files (names)
    docs: Tuple[DocsEntry, ...] = ()  # entries of docs/<tracker key>.md
    docs_committed: bool = False  # in the PR's docs commit (else in DOCS.md)
    #: Its test files are the same as an earlier PR of the stack committed: no test commit.
    tests_in_earlier_pr: bool = False

    @property
    def number(self) -> int:
        return self.tracker.number

    @property
    def key(self) -> str:
        """The PR's directory and tag name: the issue number, or ``new-NNNN`` without a tracker."""
        return str(self.number) if self.number else f"new-{self.patches[0].name[:4]}"

    @property
    def ref(self) -> str:
        """How messages name the PR: ``#N``, or the patch without a tracker."""
        return f"#{self.number}" if self.number else f"{self.patches[0].name} (no tracker yet)"

    @property
    def title(self) -> str:
        subject = self.patches[0].subject
        return subject if subject.startswith("[") else f"{self.tracker.prefix} {subject}"


@dataclass
class ApiEntry:
    name: str  # e.g. torch.distributed.fsdp.FSDPModule.partial_backward
    signature: str
    docstring: Optional[str]


def base_prefixes(series: Series) -> Tuple[str, ...]:
    """The installed base trees to export from: the manifest's prefixes plus any other
    packaged directory the series touches (``docs/`` comes from ``--source``)."""
    prefixes = series.base.prefixes
    extra = {p.rsplit("/", 1)[0] + "/" for p in series.paths
             if not p.startswith(prefixes) and series.base.is_packaged(p)}
    return tuple(prefixes) + tuple(sorted(extra))


def tracker_number(patch: Patch) -> int:
    """The pytorch/pytorch issue number of ``patch``'s DEP-3 ``Bug:`` field; ``0`` for
    ``Bug: none yet`` (a new concern without an upstream issue)."""
    bug = patch.dep3.get("Bug", "")
    m = _BUG_RE.search(bug)
    if m:
        return int(m.group(1))
    if bug.strip().lower().startswith("none"):
        return 0
    raise TorchPatchesError(
        f"{patch.name} has no pytorch/pytorch issue in its DEP-3 Bug: field ({bug or 'missing'!r}); "
        "export groups patches by it (write `Bug: none yet` for a concern without a tracker)")


def group_series(series: Series) -> List[Group]:
    """Patches grouped by tracker, in order of first appearance in the series; each
    patch without a tracker is a PR of its own."""
    groups: Dict[object, Group] = {}
    for patch in series.patches:
        n = tracker_number(patch)
        tracker = series.manifest.tracker(n, patch.name) or Tracker(n, "", f"#{n}" if n else patch.subject)
        groups.setdefault(n or patch.name, Group(tracker)).patches.append(patch)
    return list(groups.values())


# -- tests at their upstream paths --------------------------------------------
def upstream_test(text: str, where: str = "test") -> str:
    """``text`` with the ``sys.path`` insert + ``from fsdp_lifecycle_testing import``
    replaced by an import of :data:`HELPER_UPSTREAM_MODULE`, placed in sorted
    position among the ``torch`` imports (upstream sorts with usort)."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    path_stmt = imp = None
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == HELPER_MODULE:
            imp = node
        elif (imp is None and isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
              and ast.unparse(node.value.func) == "sys.path.insert"):
            path_stmt = node
    if imp is None:
        return text
    new_import = "".join(lines[imp.lineno - 1:imp.end_lineno])
    new_import = new_import.replace(f"from {HELPER_MODULE} import", f"from {HELPER_UPSTREAM_MODULE} import", 1)
    new_import = re.sub(r"[ \t]*# noqa: E402", "", new_import, count=1)
    start = (path_stmt.lineno if path_stmt is not None else imp.lineno) - 1
    while start > 0 and not lines[start - 1].strip():
        start -= 1
    del lines[start:imp.end_lineno]
    # Insert before the first top-level torch import that sorts after it.
    body = ast.parse("".join(lines)).body
    torch_imports = [n for n in body if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("torch")]
    after = [n for n in torch_imports if (n.module or "").lower() > HELPER_UPSTREAM_MODULE.lower()]
    if after:
        at = after[0].lineno - 1
    elif torch_imports:
        at = torch_imports[-1].end_lineno or torch_imports[-1].lineno
    else:
        raise TorchPatchesError(f"{where}: no torch import to place the helper import next to")
    lines[at:at] = [new_import]
    out = "".join(lines)
    # ``os``/``sys`` may only have served the sys.path insert.
    for mod in ("os", "sys"):
        used = any(isinstance(n, ast.Name) and n.id == mod for n in ast.walk(ast.parse(out)))
        if not used:
            out = re.sub(rf"^import {mod}\n", "", out, count=1, flags=re.MULTILINE)
    ast.parse(out)
    return out


def collect_tests(groups: List[Group], repo: Path, series: Series) -> List[str]:
    """Fill ``group.tests``; the helper goes with the first group whose tests use it.

    Returns warnings (missing test files: the group is exported without them).
    """
    warnings, helper_done = [], False
    for group in groups:
        if series.manifest.tracker(group.number, group.patches[0].name) is None:
            warnings.append(f"{group.ref}: no line in [trackers] of {series.directory}/manifest.ini; "
                            "exported without tests")
            continue
        for rel in group.tracker.tests:
            path = repo / rel
            if not path.is_file():
                group.missing_tests.append(rel)
                warnings.append(f"{group.ref}: test file {rel} does not exist; "
                                "its PR is exported WITHOUT tests (not ready for review)")
                continue
            text = path.read_text(encoding="utf-8")
            uses_helper = re.search(rf"^from {HELPER_MODULE} import", text, re.MULTILINE) is not None
            group.tests[rel] = upstream_test(text, rel).encode("utf-8")
            if uses_helper and not helper_done:
                helper = repo / HELPER
                if not helper.is_file():
                    raise TorchPatchesError(f"{rel} imports {HELPER_MODULE} but {HELPER} does not exist")
                group.tests[HELPER_UPSTREAM] = helper.read_bytes()
                helper_done = True
    return warnings


def docs_source_files(series: Series) -> List[str]:
    """The ``[docs] file`` if the series has docs entries: read from ``--source`` for the docs commits."""
    docs_file = series.manifest.docs_file
    return [docs_file] if docs_file and read_docs_entries(series.directory) else []


def collect_docs(groups: List[Group], series: Series) -> List[str]:
    """Fill ``group.docs`` from the series' ``docs/<tracker key>.md``; returns warnings."""
    entries = read_docs_entries(series.directory)
    if entries and not series.manifest.docs_file:
        raise TorchPatchesError(f"{series.directory}/docs/ holds docs entries but manifest.ini has no "
                                "[docs] file (the upstream docs source file they go into)")
    keys = {}
    for group in groups:
        if series.manifest.tracker(group.number, group.patches[0].name) is not None:
            keys[group.tracker.key] = group
    warnings = []
    for key, found in entries.items():
        if key in keys:
            keys[key].docs = found
        else:
            warnings.append(f"docs/{key}.md: no tracker key {key!r} with a patch in the series; not exported")
    return warnings


# -- public API -----------------------------------------------------------------
def _exports(files: Files) -> Dict[str, str]:
    """``{name: public module}`` from the ``__all__`` of every ``__init__.py`` in ``files``."""
    out: Dict[str, str] = {}
    for path in sorted(files, key=len):
        data = files[path]
        if not path.endswith("/__init__.py") or data is None:
            continue
        module = path[:-len("/__init__.py")].replace("/", ".")
        for node in ast.parse(data).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                try:
                    names = ast.literal_eval(node.value)
                except ValueError:
                    continue
                for name in names:
                    out.setdefault(name, module)
    return out


def _definitions(data: Optional[bytes]) -> Dict[str, ast.AST]:
    """``{"Name": node, "Class.method": node}`` of top-level defs and class methods."""
    out: Dict[str, ast.AST] = {}
    if data is None:
        return out
    for node in ast.parse(data).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        if isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{node.name}.{sub.name}"] = sub
    return out


def _signature(node: ast.AST) -> str:
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in node.bases)
        deco = "".join(f"@{ast.unparse(d)}\n" for d in node.decorator_list)
        return f"{deco}class {node.name}({bases})" if bases else f"{deco}class {node.name}"
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    deco = "".join(f"@{ast.unparse(d)}\n" for d in node.decorator_list)
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"{deco}def {node.name}({ast.unparse(node.args)}){returns}"


def public_api(before: Files, after: Files) -> List[ApiEntry]:
    """Public names that ``after`` adds to the files in ``before`` (the changed
    ones; ``after`` may hold more, e.g. every ``__init__.py`` for ``__all__``):
    exported top-level functions/classes and public methods of exported
    classes, with their docstrings."""
    exports = _exports(after)
    entries = []
    for path in sorted(before):
        if not path.endswith(".py") or path.startswith(("test/", "torch/testing/")):
            continue
        old, new = _definitions(before.get(path)), _definitions(after.get(path))
        for qual, node in new.items():
            if qual in old:
                continue
            owner, _, method = qual.partition(".")
            if owner not in exports or (method and method.startswith("_")):
                continue
            entries.append(ApiEntry(f"{exports[owner]}.{qual}", _signature(node),
                                    ast.get_docstring(node)))  # type: ignore[arg-type]
    return entries


# -- the git stack ----------------------------------------------------------------
def _read_tree(tree: Path, rev: str, paths: List[str]) -> Files:
    out: Files = {}
    for path in paths:
        proc = subprocess.run(["git", "-C", str(tree), "show", f"{rev}:{path}"], capture_output=True)
        out[path] = proc.stdout if proc.returncode == 0 else None
    return out


def _author(group: Group) -> Dict[str, str]:
    """The identity of the export's commits in ``group``'s PR: its last patch's author and date."""
    last = group.patches[-1]
    author = last.mail_header("From") or "torch-fsdp-lifecycle <torch-fsdp-lifecycle@localhost>"
    name, _, email = author.rpartition(" <")
    return gitstack.identity(name or author, email.rstrip(">"), last.mail_header("Date") or "2000-01-01")


def _commit_docs(tree: Path, group: Group, docs_file: str) -> None:
    """Insert ``group.docs`` into ``docs_file`` of ``tree`` and commit them."""
    path = tree / docs_file
    text = docs_mod.insert_all(path.read_text(encoding="utf-8"), group.docs, docs_file,
                               f" (the --source base with the patches of {group.ref} and the PRs before it)")
    path.write_text(text, encoding="utf-8")
    git(tree, "add", "--", docs_file)
    where = "".join(f"\n- {docs_mod.describe(e)}" for e in group.docs)
    git(tree, "commit", "-q", "-m",
        f"{group.tracker.prefix} Add docs for {group.tracker.what}\n\n"
        f"Entries for {group.ref} in\n{docs_file}:{where}\n\n"
        f"Bug: {f'{ISSUE_URL}{group.number}' if group.number else 'none yet'}", env=_author(group))
    group.docs_committed = True


def build_stack(tree: Path, base_files: Files, groups: List[Group], series: Series) -> None:
    """Create the scratch repository ``tree``: ``base``, then per tracker its
    patches (``git am``), a test commit and, when ``base_files`` holds the
    ``[docs] file``, a docs commit; tagged ``pr-<key>``."""
    gitstack.init_base(tree, base_files, series.base)
    docs_file = series.manifest.docs_file
    with_docs = bool(docs_file) and base_files.get(docs_file) is not None
    for group in groups:
        gitstack.am(tree, [p.data for p in group.patches],
                    f"{group.ref}'s patches ({', '.join(p.name for p in group.patches)}) on the trackers "
                    "before it (reorder the series so each tracker's patches are contiguous)")
        if group.tests:
            for rel, data in group.tests.items():
                (tree / rel).parent.mkdir(parents=True, exist_ok=True)
                (tree / rel).write_bytes(data)
            git(tree, "add", "--", *group.tests)
            env = _author(group)
            helper = (f"\n\nThe shared gloo/CPU test case and collective counter go to\n{HELPER_UPSTREAM}."
                      if HELPER_UPSTREAM in group.tests else "")
            staged = subprocess.run(["git", "-C", str(tree), "diff", "--cached", "--quiet"])
            group.tests_in_earlier_pr = staged.returncode == 0
        if group.tests and not group.tests_in_earlier_pr:
            git(tree, "commit", "-q", "-m",
                f"{group.tracker.prefix} Add tests for {group.tracker.what}\n\n"
                f"Multi-process tests (gloo on CPU) for {group.ref}.{helper}\n\n"
                f"Bug: {f'{ISSUE_URL}{group.number}' if group.number else 'none yet'}", env=env)
        if group.docs and with_docs:
            _commit_docs(tree, group, docs_file)
        git(tree, "tag", f"pr-{group.key}")


# -- PR description ----------------------------------------------------------------
def _body(patch: Patch) -> str:
    """The commit message body of ``patch`` without the DEP-3 fields."""
    text = patch.data.decode("utf-8", "replace")
    msg = text.split("\n\n", 1)[1] if "\n\n" in text else ""
    msg = re.split(r"^---$", msg, maxsplit=1, flags=re.MULTILINE)[0]
    kept = [line for line in msg.splitlines()
            if not re.match(r"^(Bug|Forwarded|Last-Update|Origin|Author|Applied-Upstream)(-\w+)?:", line)]
    return "\n".join(kept).strip()


def test_command(rel: str) -> str:
    return f"python {rel}"


def load_results(path: Optional[os.PathLike]) -> Dict[str, dict]:
    """Recorded test results: ``{test path: {"command", "output", "returncode", "recorded", "where"}}``."""
    if path is None:
        return {}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TorchPatchesError(f"cannot read recorded results {path}: {exc}")
    if not isinstance(data, dict):
        raise TorchPatchesError(f"{path}: expected a JSON object keyed by test path")
    return data


def pr_description(group: Group, groups: List[Group], series: Series, results: Dict[str, dict],
                   stack_lines: Optional[List[str]] = None) -> str:
    """``PR.md``; ``stack_lines`` is the PR's stack check result (``export --check-stack``)."""
    index = groups.index(group)
    before = groups[:index]
    lines = [f"# {group.title}", ""] + ([f"Fixes #{group.number}", ""] if group.number else [])
    if before:
        lines += [f"Stacked on {', '.join(g.ref for g in before)}: apply "
                  + ", then ".join(f"`../{g.key}/*.patch`" for g in before)
                  + " first (`../series` lists the whole stack in order; "
                  "`git am --keep-non-patch` keeps the subject prefix).", ""]
    lines += ["## Summary", ""]
    for patch in group.patches:
        if len(group.patches) > 1:
            lines += [f"### {patch.subject}", ""]
        lines += [_body(patch), ""]
    lines += [f"Base: PyTorch {series.base.version} (git `{series.base.git_version[:12]}`, "
              f"{series.base.git_version}). Exported from the torch-fsdp-lifecycle patch series "
              f"(revision {series.revision}, `{series.version}`): "
              + ", ".join(f"`{p.name}`" for p in group.patches) + ".", ""]
    lines += ["### Public API added", ""]
    if not group.api:
        lines += ["None: behaviour changes only.", ""]
    for entry in group.api:
        lines += [f"#### `{entry.name}`", "", "```python", entry.signature, "```", ""]
        lines += [entry.docstring or "**(no docstring)**", ""]
    if group.docs:
        docs_file = series.manifest.docs_file
        lines += ["### Docs", ""]
        where = "; ".join(docs_mod.describe(e) for e in group.docs)
        if group.docs_committed:
            lines += [f"The last commit adds entries to `{docs_file}` ({where}).", ""]
        else:
            lines += [f"**Docs not committed:** exported without `--source DIR` (a v{series.base.version} "
                      f"checkout holding `{docs_file}`). `{DOCS_NAME}` in this directory holds the entries "
                      f"for `{docs_file}` ({where}); add them to the PR before review.", ""]
    lines += ["## Test Plan", ""]
    if group.missing_tests or not group.tests:
        missing = group.missing_tests or ["(no tests mapped to this tracker)"]
        lines += ["**Tests missing:** " + ", ".join(f"`{m}`" for m in missing)
                  + " does not exist yet; this PR is not ready for review.", ""]
    if group.tests_in_earlier_pr:
        lines += ["The test files below come with an earlier PR of this stack (unchanged here).", ""]
    lines += stack_lines or []
    for rel in (r for r in group.tests if r.startswith("test/")):
        lines += ["```bash", test_command(rel), "```", ""]
        rec = results.get(rel)
        if rec is None:
            lines += [] if stack_lines else ["Not run by the export; no recorded result.", ""]
            continue
        status = "passed" if rec.get("returncode") == 0 else f"FAILED (exit {rec.get('returncode')})"
        lines += [f"Recorded {rec.get('recorded', '?')}: {status}; ran `{rec.get('command', '?')}` "
                  f"{rec.get('where', '')}".rstrip() + ". Output (tail):", "", "```",
                  str(rec.get("output", "")).rstrip(), "```", ""]
    lines += ["Lint: `ruff check` and `mypy` report no new warnings on the touched files compared with "
              f"{series.base.version} when `test/tools/test_lint.py` of torch-fsdp-lifecycle passes.", ""]
    return "\n".join(lines).rstrip() + "\n"


# -- the command --------------------------------------------------------------------
@dataclass
class ExportResult:
    out: Path
    groups: List[Group]
    warnings: List[str]
    order: List[str]  # "N/NNNN-*.patch" in git am order


def check_out(out: os.PathLike) -> None:
    """Refuse an output directory that is neither empty nor an earlier export (reads only)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        series_file = out / "series"
        header = read_series_file(out, NESTED_PATCH_NAME).header if series_file.is_file() else ()
        if not header or not header[0].startswith(_EXPORT_HEADER):
            raise TorchPatchesError(f"{out} exists, is not empty and is not an earlier export; "
                                    "choose another -o DIR")


def _prepare_out(out: Path) -> None:
    check_out(out)
    if out.exists() and any(out.iterdir()):
        series_file = out / "series"
        for child in out.iterdir():
            if child.is_dir() and (child.name.isdigit() or child.name.startswith("new-")):
                shutil.rmtree(child)
        series_file.unlink()
    out.mkdir(parents=True, exist_ok=True)


def export(series: Series, base_files: Files, out: os.PathLike, repo: os.PathLike,
           results: Optional[Dict[str, dict]] = None,
           progress: Callable[[str], None] = lambda _msg: None,
           stack_lines: Optional[Dict[str, List[str]]] = None) -> ExportResult:
    """Write the per-tracker PR directories and ``series`` under ``out``; ``stack_lines``
    holds each PR's stack check result for its Test Plan, by PR key."""
    out, repo = Path(out), Path(repo)
    if shutil.which("git") is None:
        raise TorchPatchesError("export needs git; install it")
    if not series.patches:
        raise TorchPatchesError("the series is empty: nothing to export")
    groups = group_series(series)
    warnings = collect_tests(groups, repo, series)
    warnings += collect_docs(groups, series)
    for t in series.manifest.trackers:
        if t.number and t.number not in {g.number for g in groups}:
            warnings.append(f"#{t.number}: no patch in the series names it (not written yet, or retired); skipped")
        elif not t.number and not any(t.match.lower() in p.name.lower() for p in series.patches):
            warnings.append(f"[trackers] {t.match}: no patch file name contains it; skipped")
    _prepare_out(out)
    order: List[str] = []
    with tempfile.TemporaryDirectory(prefix="torch-patches-export-") as tmp:
        tree = Path(tmp) / "pytorch"
        build_stack(tree, base_files, groups, series)
        warnings += [f"{g.ref}: its test files are unchanged from an earlier PR of the stack "
                     "(the same [trackers] test file); no test commit" for g in groups if g.tests_in_earlier_pr]
        prev = "base"
        for group in groups:
            tag = f"pr-{group.key}"
            changed = [p for p in git(tree, "diff", "--name-only", prev, tag).splitlines() if p]
            all_py = [p for p in git(tree, "ls-files").splitlines() if p.endswith(".py")]
            group.api = public_api(_read_tree(tree, prev, changed), {**_read_tree(tree, tag, changed),
                                   **_read_tree(tree, tag, [p for p in all_py if p.endswith("__init__.py")])})
            for entry in group.api:
                if not entry.docstring:
                    warnings.append(f"{group.ref}: {entry.name} has no docstring")
            dest = out / group.key
            group.files = [p.name for p in gitstack.format_patch(tree, f"{prev}..{tag}", dest)]
            order += [f"{group.key}/{name}" for name in group.files]
            if group.docs and not group.docs_committed:
                why = (f"Not committed: the export had no `--source DIR` (a v{series.base.version} checkout) "
                       f"for the base content of `{series.manifest.docs_file}`. Insert each snippet "
                       "there, separated by blank lines.")
                (dest / DOCS_NAME).write_text(
                    docs_mod.docs_markdown(group.ref, group.docs, series.manifest.docs_file, why), encoding="utf-8")
            (dest / "PR.md").write_text(pr_description(group, groups, series, results or {},
                                                       (stack_lines or {}).get(group.key)), encoding="utf-8")
            progress(f"{group.ref}: {len(group.files)} patch(es) -> {dest}  ({group.title})")
            prev = tag
    (out / "series").write_text(
        f"{_EXPORT_HEADER} pytorch/pytorch PR stack against {series.base.version} ({series.base.git_version[:12]}),\n"
        f"# series revision {series.revision}. Apply in this order with `git am --keep-non-patch`\n"
        f"# (keeps the [FSDP2]/[pipelining] subject prefix); one directory per PR.\n"
        + "".join(line + "\n" for line in order), encoding="utf-8")
    return ExportResult(out, groups, warnings, order)


def run_tests(groups: List[Group], repo: Path, python: str, results_file: Path, base_version: str,
              progress: Callable[[str], None] = lambda _msg: None) -> Dict[str, dict]:
    """Run each exported tracker's tests from this checkout with ``python`` and record them.

    The recorded command is the one run (the checkout's copy of the test, which
    differs from the exported one only in how it imports the helper).
    """
    import datetime
    results = load_results(results_file) if results_file.is_file() else {}
    for group in groups:
        for rel in group.tracker.tests:
            if not (repo / rel).is_file():
                continue
            progress(f"running {python} {rel} ...")
            proc = subprocess.run([resolve_python(python), rel], cwd=repo, capture_output=True, text=True)
            tail = "\n".join((proc.stdout + proc.stderr).rstrip().splitlines()[-15:])
            results[rel] = {"command": f"{python} {rel}", "returncode": proc.returncode, "output": tail,
                            "recorded": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                            "where": f"in a torch-fsdp-lifecycle checkout, torch {base_version} "
                                     "with the series applied"}
            progress(f"  exit {proc.returncode}")
    results_file.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return results
