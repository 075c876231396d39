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
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

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
