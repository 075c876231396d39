"""torch-patches torchtitan: the consumer series' apply/revert/status/export guarantees.

A synthetic installed distribution ``torchtitan`` (one module, a dist-info with a
``\\r\\n`` RECORD as pip writes it) in a temporary site-packages; the series is
written by ``git format-patch`` style text here. The shipped series is also applied
to a copy of the installed torchtitan 0.3.0 when one is installed.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Optional, Tuple

import pytest

from tooling import REPO, python_wrapper

from torch_patches import consumers
from torch_patches.errors import TorchPatchesError

MODULE = "torchtitan/components/loss.py"
PRISTINE = b"".join(b"line %d\n" % i for i in range(1, 21))


def _format_patch(subject: str, path: str, hunk: str) -> str:
    """A one-file ``git format-patch`` text changing one line of ``path``."""
    return textwrap.dedent("""\
        From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
        From: torch-fsdp-lifecycle <torch-fsdp-lifecycle@users.noreply.github.com>
        Date: Tue, 1 Dec 2026 00:00:00 +0000
        Subject: [PATCH] {subject}

        Bug: none
        Forwarded: not-needed
        Last-Update: 2026-12-01
        ---
         {path} | 2 +-
         1 file changed, 1 insertion(+), 1 deletion(-)

        diff --git a/{path} b/{path}
        --- a/{path}
        +++ b/{path}
        """).format(subject=subject, path=path) + textwrap.dedent(hunk)


PATCH = _format_patch("[loss] change line 10", MODULE, """\
    @@ -9,3 +9,3 @@
     line 9
    -line 10
    +line ten
     line 11
    """)


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _site(tmp_path: Path, version: str = "0.3.0", content: bytes = PRISTINE) -> Path:
    site = tmp_path / "site"
    (site / "torchtitan/components").mkdir(parents=True)
    (site / "torchtitan/__init__.py").write_bytes(b"")
    (site / MODULE).write_bytes(content)
    di = site / f"torchtitan-{version}.dist-info"
    di.mkdir()
    (di / "METADATA").write_text(f"Metadata-Version: 2.4\nName: torchtitan\nVersion: {version}\n\n")
    rows = [f"torchtitan/__init__.py,{_hash(b'')},0", f"{MODULE},{_hash(PRISTINE)},{len(PRISTINE)}",
            f"{di.name}/METADATA,,", f"{di.name}/RECORD,,"]
    (di / "RECORD").write_bytes("".join(r + "\r\n" for r in rows).encode())
    return site


def _series(tmp_path: Path, patch: str = PATCH, revision: int = 1, version: str = "0.3.0") -> Path:
    d = tmp_path / f"series-{revision}"
    d.mkdir()
    (d / "manifest.ini").write_text(f"[base]\ndistribution = torchtitan\nversion = {version}\n"
                                    f"repository = pytorch/torchtitan\n[series]\nrevision = {revision}\n")
    (d / "series").write_text("0001-change.patch\n")
    (d / "0001-change.patch").write_text(patch)
    (d / "PR.md.in").write_text("{patches}\n{private_counts}\n{collective_table}\n{apply}\n")
    return d


def _python(site: Path, tmp_path: Path) -> str:
    return python_wrapper(site, tmp_path / "bin" / "python")


def _snapshot(site: Path) -> dict:
    return {str(p.relative_to(site)): p.read_bytes() for p in sorted(site.rglob("*")) if p.is_file()}


def _target(tmp_path, site, series_dir):
    return consumers.InstalledConsumer(consumers.load_consumer_series(series_dir), _python(site, tmp_path))


def test_apply_revert_exact_and_idempotent(tmp_path):
    site = _site(tmp_path)
    before = _snapshot(site)
    target = _target(tmp_path, site, _series(tmp_path))
    assert "applied consumer series revision 1" in consumers.apply(target)
    assert (site / MODULE).read_bytes() == PRISTINE.replace(b"line 10\n", b"line ten\n")
    record = (site / "torchtitan-0.3.0.dist-info/RECORD").read_bytes()
    assert record.count(b"\r\n") == record.count(b"\n")  # pip's line ends kept
    patched = _snapshot(site)
    assert "already applied" in consumers.apply(target)
    assert _snapshot(site) == patched
    assert any("state:       applied" == line for line in consumers.status(target))
    assert "reverted" in consumers.revert(target)
    assert _snapshot(site) == before
    assert "nothing to revert" in consumers.revert(target)


def test_pinned_base_and_all_or_nothing(tmp_path):
    site = _site(tmp_path, version="0.2.2")
    before = _snapshot(site)
    with pytest.raises(TorchPatchesError, match="pinned to 0.3.0"):
        consumers.apply(_target(tmp_path, site, _series(tmp_path)))
    assert _snapshot(site) == before
    # A file that is not the released bytes (RECORD disagrees)
    (tmp_path / "b").mkdir()
    site2 = _site(tmp_path / "b", content=PRISTINE + b"local edit\n")
    before = _snapshot(site2)
    with pytest.raises(TorchPatchesError, match="differ from the installed release"):
        consumers.apply(_target(tmp_path / "b", site2, _series(tmp_path / "b")))
    assert _snapshot(site2) == before
    # A hunk that does not apply: nothing written
    (tmp_path / "c").mkdir()
    site3 = _site(tmp_path / "c")
    before = _snapshot(site3)
    bad = PATCH.replace(" line 11\n", " line 12\n")
    with pytest.raises(TorchPatchesError, match="nothing was changed"):
        consumers.apply(_target(tmp_path / "c", site3, _series(tmp_path / "c", bad)))
    assert _snapshot(site3) == before


def test_revert_refuses_changed_file_and_switch_revision(tmp_path):
    site = _site(tmp_path)
    before = _snapshot(site)
    target = _target(tmp_path, site, _series(tmp_path))
    consumers.apply(target)
    # Another revision switches from the marker's pristine bytes
    rev2 = _series(tmp_path, PATCH.replace("+line ten", "+line TEN"), revision=2)
    target2 = _target(tmp_path, site, rev2)
    assert "switched to consumer series revision 2" in consumers.apply(target2)
    assert b"line TEN\n" in (site / MODULE).read_bytes()
    (site / MODULE).write_bytes(b"edited\n")
    edited = _snapshot(site)
    with pytest.raises(TorchPatchesError, match="changed since apply"):
        consumers.revert(target2)
    assert _snapshot(site) == edited
    (site / MODULE).write_bytes(PRISTINE.replace(b"line 10\n", b"line TEN\n"))
    consumers.revert(target2)
    assert _snapshot(site) == before


def test_cli_and_export(tmp_path):
    site = _site(tmp_path)
    series_dir = _series(tmp_path)
    py = _python(site, tmp_path)
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"rows": [
        {"scenario": "s", "wrapper": "w", "reduce_scatter": 4, "all_gather": 4,
         "policy_kept": True, "max_grad_diff": 0.0}]}))
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "torch_patches", "torchtitan", *a, "--series", str(series_dir), "--python", py],
        capture_output=True, text=True, cwd=REPO)
    proc = run("export", "-o", str(tmp_path / "out"), "--results", str(results))
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    assert (out / "0001-change.patch").read_text() == PATCH
    assert (out / "series").read_text() == "0001-change.patch\n"
    pr = (out / "PR.md").read_text()
    assert "| s | w | 4 | - | - | 4 | kept | 0.00e+00 | - |" in pr and "git am --keep-non-patch 0001-change.patch" in pr
    assert f"| `{MODULE}` | 0 | 0 |" in pr
    assert run("apply").returncode == 0
    assert "state:       applied" in run("status").stdout
    proc = run("status", "--onto", "HEAD")  # for a series against a commit only
    assert proc.returncode == 1 and "--source and --onto are for a series against a torchtitan commit" in proc.stderr
    assert run("revert").returncode == 0


TEST_PATCH = _format_patch("[loss] test the change", "tests/unit_tests/test_loss.py", """\
    @@ -1,2 +1,2 @@
     import unittest
    -assert "line 10"
    +assert "line ten"
    """)


def test_source_only_paths_are_skipped_and_exported(tmp_path):
    """A patch for the PR's tests/ (not in the installed release) is skipped by
    apply and status, named in their output, and exported unchanged."""
    site = _site(tmp_path)
    series_dir = _series(tmp_path)
    (series_dir / "manifest.ini").write_text(
        (series_dir / "manifest.ini").read_text().replace("[series]", "packaged = torchtitan/\n[series]"))
    (series_dir / "0002-test.patch").write_text(TEST_PATCH)
    (series_dir / "series").write_text("0001-change.patch\n0002-test.patch\n")
    target = _target(tmp_path, site, series_dir)
    assert target.series.paths == [MODULE]
    assert target.skipped == ["tests/unit_tests/test_loss.py"]
    before = _snapshot(site)
    out = consumers.apply(target)
    assert "(2 patch(es), 1 file(s))" in out, out
    assert "skipped tests/unit_tests/test_loss.py: not part of an installed torchtitan (export includes it)" in out
    assert not (site / "tests").exists()
    assert list(target.marker()["files"]) == [MODULE]
    assert (site / MODULE).read_bytes() == PRISTINE.replace(b"line 10\n", b"line ten\n")
    status = "\n".join(consumers.status(target))
    assert "state:       applied" in status
    assert "note:        tests/unit_tests/test_loss.py is not part of an installed torchtitan" in status
    exported = consumers.export(target, tmp_path / "out")
    assert (exported / "0002-test.patch").read_text() == TEST_PATCH
    assert (exported / "series").read_text() == "0001-change.patch\n0002-test.patch\n"
    pr = (exported / "PR.md").read_text()
    assert f"| `{MODULE}` | 0 | 0 |" in pr and "tests/unit_tests/test_loss.py" not in pr.split("git am")[0]
    assert "git am --keep-non-patch 0001-change.patch 0002-test.patch" in pr
    consumers.revert(target)
    assert _snapshot(site) == before


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed")
def test_shipped_series_applies_to_installed_torchtitan(tmp_path):
    """The shipped series against a copy of the installed release (reverted first if patched)."""
    spec = importlib.util.find_spec("torchtitan")
    root = Path(list(spec.submodule_search_locations)[0]).parent
    site = tmp_path / "site"
    (site / "torchtitan/components").mkdir(parents=True)
    (site / "torchtitan/__init__.py").write_bytes(b"")
    shutil.copy2(root / MODULE, site / MODULE)
    for di in root.glob("torchtitan-*.dist-info"):
        shutil.copytree(di, site / di.name, ignore=shutil.ignore_patterns("licenses"))
    series_dir = REPO / "consumers" / "torchtitan" / "0.3.0"
    target = _target(tmp_path, site, series_dir)
    if target.marker() is not None:
        consumers.revert(target)
    before = _snapshot(site)
    consumers.apply(target)
    text = (site / MODULE).read_bytes()
    assert sum(consumers.private_references(text).values()) == 0
    assert b"partial_backward(" in text
    consumers.revert(target)
    assert _snapshot(site) == before


# -- a series against a commit of a branch (consumers/torchtitan/main-<sha>/) ----------------
_GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@e", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null"}
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")


def _git(tree: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True,
                          env=dict(os.environ, **_GIT_ENV))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def _upstream(tmp_path: Path) -> Tuple[Path, str]:
    """A torchtitan-shaped git repository written here (loss.py and its test), and its commit."""
    repo = tmp_path / "upstream"
    (repo / "torchtitan/components").mkdir(parents=True)
    (repo / "tests/unit_tests").mkdir(parents=True)
    (repo / MODULE).write_bytes(PRISTINE)
    (repo / "tests/unit_tests/test_loss.py").write_bytes(b'import unittest\nassert "line 10"\n')
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "base")
    return repo, _git(repo, "rev-parse", "HEAD")


def _branch_series(tmp_path: Path, repo: Path, commit: str) -> Path:
    """The series as the project writes one: commits on a scratch clone, then
    ``git format-patch -N --zero-commit --full-index --no-signature``."""
    work = tmp_path / "work"
    _git(tmp_path, "clone", "-q", str(repo), str(work))
    (work / MODULE).write_bytes(PRISTINE.replace(b"line 10\n", b"line ten\n"))
    _git(work, "commit", "-q", "-am", "[loss] change line 10\n\nBug: none\nForwarded: not-needed\n"
         "Last-Update: 2026-12-02")
    (work / "tests/unit_tests/test_loss.py").write_bytes(b'import unittest\nassert "line ten"\n')
    _git(work, "commit", "-q", "-am", "[loss] test the change\n\nBug: none\nForwarded: not-needed\n"
         "Last-Update: 2026-12-02")
    d = tmp_path / f"main-{commit[:9]}"
    _git(work, "format-patch", "-q", "-N", "--zero-commit", "--full-index", "--no-signature", "-o", str(d),
         f"{commit}..HEAD")
    names = sorted(p.name for p in d.glob("*.patch"))
    (d / "series").write_text("".join(n + "\n" for n in names))
    (d / "manifest.ini").write_text("[base]\ndistribution = torchtitan\nrepository = pytorch/torchtitan\n"
                                    f"branch = main\ncommit = {commit}\n[series]\nrevision = 1\n")
    (d / "PR.md.in").write_text("{base} {short_commit}\n{patches}\n{private_counts}\n{apply}\n")
    return d


def _cli(series_dir: Path, *args: str, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch_patches", "torchtitan", *args, "--series", str(series_dir)],
                          capture_output=True, text=True, cwd=REPO,
                          env=dict({k: v for k, v in os.environ.items() if k != consumers.SOURCE_ENV}, **(env or {})))


def _am(tmp_path: Path, repo: Path, commit: str, export_dir: Path, paths) -> Path:
    """``git am --keep-non-patch`` of an export onto the commit's files (a ``git archive`` in a new repo)."""
    tree = tmp_path / "am"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(repo), "archive", commit, *paths], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    _git(tree, "init", "-q")
    _git(tree, "add", "-A")
    _git(tree, "commit", "-q", "-m", f"archive of {commit}")
    names = (export_dir / "series").read_text().split()
    _git(tree, "am", "-q", consumers.GIT_AM_OPTIONS, *[str(export_dir / n) for n in names])
    return tree


@needs_git
def test_branch_series_export_git_am_and_moved_check(tmp_path):
    """A main-<sha> series: export from the source's commit (env or --source), git am of the
    export onto that commit's files, and status --onto: current, moved but applying, conflicting."""
    repo, commit = _upstream(tmp_path)
    series_dir = _branch_series(tmp_path, repo, commit)
    s = consumers.load_consumer_series(series_dir)
    assert (s.commit, s.branch, s.version, s.base_label) == (commit, "main", "", f"main at {commit[:9]}")
    out = tmp_path / "out"
    proc = _cli(series_dir, "export", "-o", str(out), env={consumers.SOURCE_ENV: str(repo)})
    assert proc.returncode == 0, proc.stderr
    pr = (out / "PR.md").read_text()
    assert pr.startswith(f"main at {commit[:9]} {commit[:9]}\n")
    assert f"| `{MODULE}` | 0 | 0 |" in pr and "git am --keep-non-patch 0001-" in pr
    tree = _am(tmp_path, repo, commit, out, ["torchtitan", "tests"])
    assert (tree / MODULE).read_bytes() == PRISTINE.replace(b"line 10\n", b"line ten\n")
    assert _git(tree, "log", "-1", "--format=%s", "HEAD~1") == "[loss] change line 10"
    # status: current at the commit
    proc = _cli(series_dir, "status", "--source", str(repo))
    assert proc.returncode == 0 and "state:       current" in proc.stdout, proc.stdout + proc.stderr
    # main moves away from the patched lines: the patches apply with offsets
    (repo / MODULE).write_bytes(b"new first line\n" + PRISTINE)
    _git(repo, "commit", "-q", "-am", "upstream: a line on top")
    proc = _cli(series_dir, "status", "--source", str(repo))
    assert proc.returncode == 0, proc.stderr
    assert f"{MODULE}: changed since {commit[:9]}" in proc.stdout
    assert "touched by" in proc.stdout and "upstream: a line on top" in proc.stdout
    assert "  applies          0001-" in proc.stdout and "state:       moved: main changed" in proc.stdout
    # ... and over them: the series conflicts (exit 1); the old commit is still current
    (repo / MODULE).write_bytes(PRISTINE.replace(b"line 10\n", b"line X\n"))
    _git(repo, "commit", "-q", "-am", "upstream: line 10 changes")
    proc = _cli(series_dir, "status", "--source", str(repo))
    assert proc.returncode == 1 and "the series CONFLICTS" in proc.stdout, proc.stdout
    assert "  conflicts        0001-" in proc.stdout and f"does not apply to {MODULE}" in proc.stdout
    assert "state:       current" in _cli(series_dir, "status", "--source", str(repo), "--onto", commit).stdout
    # export still writes the PR for the series' commit, and --onto checks it against main
    proc = _cli(series_dir, "export", "-o", str(tmp_path / "out2"), "--source", str(repo), "--onto", "HEAD")
    assert proc.returncode == 1 and "export: 2 patch(es)" in proc.stdout and "CONFLICTS" in proc.stdout


@needs_git
def test_branch_series_refusals(tmp_path):
    """No source, a plain directory that is not the commit, apply/revert: clear errors, nothing written."""
    repo, commit = _upstream(tmp_path)
    series_dir = _branch_series(tmp_path, repo, commit)
    proc = _cli(series_dir, "export", "-o", str(tmp_path / "out"))
    assert proc.returncode == 1 and f"pass --source DIR or set {consumers.SOURCE_ENV}" in proc.stderr
    assert not (tmp_path / "out").exists()
    plain = tmp_path / "plain"
    (plain / "torchtitan/components").mkdir(parents=True)
    (plain / "tests/unit_tests").mkdir(parents=True)
    (plain / MODULE).write_bytes(PRISTINE)
    (plain / "tests/unit_tests/test_loss.py").write_bytes(b"something else\n")
    proc = _cli(series_dir, "export", "-o", str(tmp_path / "out"), "--source", str(plain))
    assert proc.returncode == 1 and "is not torchtitan main at" in proc.stderr, proc.stderr
    assert "tests/unit_tests/test_loss.py is blob" in proc.stderr and not (tmp_path / "out").exists()
    (plain / "tests/unit_tests/test_loss.py").write_bytes(b'import unittest\nassert "line 10"\n')
    proc = _cli(series_dir, "export", "-o", str(tmp_path / "out"), "--source", str(plain))
    assert proc.returncode == 0, proc.stderr  # a plain directory with the commit's blobs
    proc = _cli(series_dir, "status", "--source", str(plain), "--onto", "HEAD")
    assert proc.returncode == 1 and "not a git directory" in proc.stderr
    for action in ("apply", "revert"):
        proc = _cli(series_dir, action, "--source", str(repo))
        assert proc.returncode == 3 and "not a release" in proc.stderr, proc.stderr
    proc = _cli(series_dir, "status", "--source", str(repo), "--onto", "no-such-rev")
    assert proc.returncode == 1 and "has no commit 'no-such-rev'" in proc.stderr


def test_shipped_targets():
    """Both shipped series load; without --target the release series is the default (apply/revert/status
    of an installed torchtitan and the benchmark's series), and --target names the others."""
    assert consumers.default_consumer_dir().name == "0.3.0"
    names = [d.name for d in consumers.consumer_dirs()]
    assert "0.3.0" in names and any(n.startswith("main-") for n in names)
    for name in names:
        s = consumers.load_consumer_series(consumers.consumer_dir(name))
        assert [p.name for p in s.patches] and all(not p.missing_dep3() for p in s.patches)
        if s.commit:
            assert name == f"main-{s.commit[:9]}" and s.branch == "main"
            # --full-index: the index lines name the commit's blobs exactly (the moved check)
            assert all(len(fp.old_blob) == 40 for fp in s.file_patches)
        else:
            assert name == s.version
    with pytest.raises(TorchPatchesError, match="targets: 0.3.0, main-"):
        consumers.consumer_dir("nope")


def _main_source() -> Tuple[Path, "consumers.ConsumerSeries"]:
    source = os.environ.get(consumers.SOURCE_ENV)
    if not source:
        pytest.skip(f"{consumers.SOURCE_ENV} is not set: point it at a torchtitan git directory (a checkout or "
                    "a bare clone) that has the main-<sha> series' commit, or at that commit's files")
    (main_dir,) = [d for d in consumers.consumer_dirs() if d.name.startswith("main-")]
    return Path(source), consumers.load_consumer_series(main_dir)


@needs_git
def test_shipped_main_series_on_torchtitan_main(tmp_path):
    """With $TORCHTITAN_SOURCE: the export of the shipped main series applies with ``git am`` onto the
    commit's files, and the patched files reference no private FSDP state (the check the installed
    0.3.0 series gets in test/consumers/torchtitan/test_consumer_patch.py)."""
    source, s = _main_source()
    tree = consumers.SourceTree(str(source))
    out = consumers.export_from_source(s, tree, tmp_path / "out")
    if tree.is_git:
        am = _am(tmp_path, source, s.commit, out, s.paths)
    else:  # the commit's files: copy the ones the series patches
        am = tmp_path / "am"
        for rel in s.paths:
            (am / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / rel, am / rel)
        _git(am, "init", "-q")
        _git(am, "add", "-A")
        _git(am, "commit", "-q", "-m", "the commit's files")
        _git(am, "am", "-q", consumers.GIT_AM_OPTIONS, *[str(out / p.name) for p in s.patches])
    subjects = _git(am, "log", f"-{len(s.patches)}", "--reverse", "--format=%s").splitlines()
    assert subjects == [p.subject for p in s.patches]
    loss = (am / MODULE).read_text()
    counts = consumers.private_references(loss.encode())
    assert sum(counts.values()) == 0, counts
    for setter in ("set_reshard_after_forward(", "set_reshard_after_backward(", "set_requires_gradient_sync("):
        assert setter not in loss
    for call in ("partial_backward(", "finish_forward(", "fsdp_policy("):
        assert call in loss
    assert "| `torchtitan/components/loss.py` | 0 | 0 |" in (out / "PR.md").read_text()
    lines, ok = consumers.check_source(s, tree, s.commit if tree.is_git else None)
    assert ok and lines[-1].startswith("state:       current"), lines
