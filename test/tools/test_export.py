"""export: per-tracker format-patch stacks and PR.md; --onto; patch retirement."""

import os
import shutil
import subprocess
import textwrap

import pytest

from tooling import API, BASE, STATE, edit, load, run_cli, tree_digest, unified, write_patch, write_series
from torch_patches import ops
from torch_patches.upstream import export as ex
from torch_patches.targets.installed import run_locate
from torch_patches.upstream.onto import check_onto
from torch_patches.record import Record
from torch_patches.state import RETIRED, apply_series, retired_reason
from torch_patches.series import parse_patch

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
POLICY_TEST = "test/distributed/_composable/fsdp/test_fully_shard_policy.py"
ENV = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@e", GIT_COMMITTER_NAME="t",
           GIT_COMMITTER_EMAIL="t@e")

TEST_FILE = textwrap.dedent('''\
    # Owner(s): ["oncall: distributed"]
    import os
    import sys

    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.common_utils import run_tests


    sys.path.insert(
        0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    )
    from fsdp_lifecycle_testing import (  # noqa: E402
        GlooMultiProcessTestCase,
    )


    class TestPolicy(GlooMultiProcessTestCase):
        def test_x(self):
            fully_shard(torch.nn.Linear(2, 2))


    if __name__ == "__main__":
        run_tests()
    ''')


def _git(tree, *args):
    return subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True, text=True,
                          env=ENV).stdout


def _base_files(pristine_site):
    return {str(p.relative_to(pristine_site)): p.read_bytes()
            for prefix in BASE.prefixes for p in (pristine_site / prefix).rglob("*.py")}


@pytest.fixture
def stack(pristine_site, tmp_path):
    """Two trackers: 0001 (#203177) edits _fsdp_api.py, 0002 (#203176) _fsdp_state.py;
    a checkout with #203177's test and the helper, and no #203176 test."""
    d = tmp_path / "series"
    d.mkdir()
    api = (pristine_site / API).read_bytes()
    state = (pristine_site / STATE).read_bytes()
    api1 = api.replace(b"\nclass ", b"\nclass FSDPPolicy:\n    \"\"\"A policy.\"\"\"\n\n\nclass ", 1)
    write_patch(d, "0001-policy.patch", "Add policy", unified(API, api, api1))
    p2 = write_patch(d, "0002-partial.patch", "Add partial", unified(STATE, state, edit(state, "0002")))
    p2.write_text(p2.read_text().replace("issues/203177", "issues/203176"))
    write_series(d, ["0001-policy.patch", "0002-partial.patch"])
    repo = tmp_path / "repo"
    (repo / POLICY_TEST).parent.mkdir(parents=True)
    (repo / POLICY_TEST).write_text(TEST_FILE)
    (repo / ex.HELPER).write_text("# Owner(s): [\"oncall: distributed\"]\nclass GlooMultiProcessTestCase:\n    pass\n")
    init = (pristine_site / "torch/distributed/fsdp/__init__.py").read_text()
    assert '"FSDPModule"' in init
    return load(d), repo


def test_upstream_test_rewrites_helper_import():
    out = ex.upstream_test(TEST_FILE)
    assert "sys.path" not in out and "fsdp_lifecycle_testing" not in out and "noqa" not in out
    assert "import os\n" not in out and "import sys\n" not in out
    assert out.startswith('# Owner(s): ["oncall: distributed"]\n') and out.rstrip().endswith("run_tests()")
    # sorted among the torch imports (usort): before common_utils
    assert out.index("common_fsdp_lifecycle import (") < out.index("common_utils import run_tests")
    assert "from torch.testing._internal.common_fsdp_lifecycle import (\n    GlooMultiProcessTestCase,\n)\n" in out


def test_export_stack_applies_with_git_am(pristine_site, stack, tmp_path):
    series, repo = stack
    base_files = _base_files(pristine_site)
    out = tmp_path / "upstream"
    result = ex.export(series, base_files, out, repo)
    assert [g.number for g in result.groups] == [203177, 203176]
    assert any("#203176: test file" in w and "does not exist" in w for w in result.warnings)
    assert any("#203178: no patch" in w for w in result.warnings)

    pr = (out / "203177" / "PR.md").read_text()
    assert pr.startswith("# [FSDP2] Add policy\n") and "Fixes #203177" in pr
    assert "## Summary" in pr and "## Test Plan" in pr and f"python {POLICY_TEST}" in pr
    assert BASE.git_version[:12] in pr and BASE.version in pr
    assert "Not run by the export" in pr  # nothing invented
    pr2 = (out / "203176" / "PR.md").read_text()
    assert "Fixes #203176" in pr2 and "Stacked on #203177" in pr2 and "Tests missing" in pr2

    # git am of the whole stack onto a git tree of the base files
    tree = tmp_path / "pytorch"
    for rel, data in base_files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(data)
    _git(tree, "init", "-q")
    _git(tree, "add", "-A")
    _git(tree, "commit", "-qm", "base")
    order = [out / line for line in (out / "series").read_text().splitlines() if not line.startswith("#")]
    assert [p.parent.name for p in order] == ["203177", "203177", "203176"]
    _git(tree, "am", "-q", "--keep-non-patch", *map(str, order))
    expected = apply_series(series, {API: base_files[API], STATE: base_files[STATE]})
    assert (tree / API).read_bytes() == expected[API] and (tree / STATE).read_bytes() == expected[STATE]
    test = (tree / POLICY_TEST).read_text()
    assert "from torch.testing._internal.common_fsdp_lifecycle import" in test and "sys.path" not in test
    assert (tree / ex.HELPER_UPSTREAM).is_file()
    log = _git(tree, "log", "--format=%s", "-3").splitlines()
    assert log == ["[FSDP2] Add partial", "[FSDP2] Add tests for value-based FSDPPolicy", "[FSDP2] Add policy"]

    # re-export into the same directory is allowed; a foreign directory is refused
    ex.export(series, base_files, out, repo)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x").write_text("x")
    with pytest.raises(ex.TorchPatchesError, match="not an earlier export"):
        ex.export(series, base_files, foreign, repo)


def test_public_api_lists_exported_names_with_docstrings():
    init = b'from ._a import FSDPModule, FSDPPolicy\n__all__ = ["FSDPModule", "FSDPPolicy"]\n'
    before = {"pkg/_a.py": b"class FSDPModule:\n    def old(self):\n        pass\n", "pkg/__init__.py": init}
    after = {"pkg/_a.py": b'class FSDPModule:\n    def old(self):\n        pass\n\n'
                          b'    def finish_forward(self, output: int) -> int:\n        """Finish it."""\n'
                          b'    def _private(self):\n        pass\n\n'
                          b'class FSDPPolicy:\n    """A value."""\n\n'
                          b'class Internal:\n    def public(self):\n        pass\n',
             "pkg/__init__.py": init}
    entries = ex.public_api({"pkg/_a.py": before["pkg/_a.py"]}, after)
    assert [(e.name, e.docstring) for e in entries] == [
        ("pkg.FSDPModule.finish_forward", "Finish it."), ("pkg.FSDPPolicy", "A value.")]
    assert entries[0].signature == "def finish_forward(self, output: int) -> int"


def _exported(pristine_site, stack, tmp_path):
    series, repo = stack
    out = tmp_path / "upstream"
    ex.export(series, _base_files(pristine_site), out, repo)
    return series, out


def _tree(pristine_site, tmp_path, name, changes=None):
    tree = tmp_path / name
    for rel in (API, STATE):
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes((pristine_site / rel).read_bytes())
    for rel, fn in (changes or {}).items():
        (tree / rel).write_bytes(fn((tree / rel).read_bytes()))
    return tree


def test_onto_clean_offsets_conflicts_in_tree(pristine_site, stack, tmp_path):
    series, out = _exported(pristine_site, stack, tmp_path)
    lines, ok = check_onto(out, _tree(pristine_site, tmp_path, "same"))
    assert ok and all("applies cleanly" in line for line in lines if ".patch" in line), lines

    shifted = _tree(pristine_site, tmp_path, "shifted",
                    {API: lambda d: b"# upstream\n" * 5 + d, STATE: lambda d: b"# upstream\n" * 3 + d})
    lines, ok = check_onto(out, shifted)
    text = "\n".join(lines)
    assert ok and "applies with offsets   203177/0001-FSDP2-Add-policy.patch" in text, text
    assert f"{API}: @@" in text and "found +5 lines away" in text and "found +3 lines away" in text

    # conflicting edit of the line 0002 changes context around (the first lines of the file)
    conflict = _tree(pristine_site, tmp_path, "conflict",
                     {STATE: lambda d: b"# rewritten upstream\n" + d.split(b"\n", 1)[1]})
    lines, ok = check_onto(out, conflict)
    text = "\n".join(lines)
    assert not ok and "conflicts" in text and f"{STATE}: @@ -1," in text and "does not match" in text, text
    assert "applies cleanly        203177/0001-FSDP2-Add-policy.patch" in text

    # a tree that already contains #203177's source patch (upstream merged it)
    merged = _tree(pristine_site, tmp_path, "merged")
    new = apply_series(series, {API: (merged / API).read_bytes(), STATE: (merged / STATE).read_bytes()})
    (merged / API).write_bytes(new[API])
    lines, ok = check_onto(out, merged)
    text = "\n".join(lines)
    line = next(line for line in lines if "203177/0001-FSDP2-Add-policy.patch" in line)
    assert line.strip().startswith("already in tree"), text
    assert "reverse-applies cleanly" in text and ok


def test_export_cli_needs_git_and_prints_summary(fake_python, stack, tmp_path):
    series, repo = stack
    out = tmp_path / "cli-out"
    proc = run_cli("export", "-o", out, "--python", fake_python, "--repo", repo, "--series", series.directory,
                   "--onto", _tree_from_site(fake_python, tmp_path), check=0)
    assert "export: 3 patch(es) for 2 PR(s)" in proc.stdout and "warning: #203176: test file" in proc.stdout
    assert "onto: every patch applies" in proc.stdout
    assert (out / "203177" / "PR.md").is_file()


def _tree_from_site(fake_python, tmp_path):
    info = run_locate(fake_python)
    site = os.path.dirname(os.path.dirname(info["torch_init"]))
    tree = tmp_path / "onto"
    for prefix in BASE.prefixes:
        shutil.copytree(os.path.join(site, prefix), tree / prefix)
    return tree


# -- retirement ------------------------------------------------------------------
def _bake_into_base(site, files):
    """Make ``files`` part of the installed base: write them and their RECORD rows."""
    di = next(site.glob("torch-*.dist-info"))
    rec = Record((di / "RECORD").read_text())
    rec.update(files)
    (di / "RECORD").write_text(rec.text())
    for rel, data in files.items():
        (site / rel).write_bytes(data)


def test_retired_patch_is_skipped(site, fake_python, two_patches):
    series = load(two_patches)
    api = (site / API).read_bytes()
    _bake_into_base(site, {API: apply_series(load_first(series), {API: api})[API]})  # upstream merged 0001
    status = run_cli("status", "--python", fake_python, "--series", two_patches, check=0).stdout
    assert "retired      0001-first.patch" in status and "not applied  0002-second.patch" in status, status
    assert "already in base: retired" in status
    out = run_cli("apply", "--python", fake_python, "--series", two_patches, check=0).stdout
    assert "applied series revision" in out and ": 1 patch" in out
    assert "skipped 0001-first.patch: already in base: retired" in out
    status = run_cli("status", "--python", fake_python, "--series", two_patches, check=0).stdout
    assert "retired      0001-first.patch" in status and "applied      0002-second.patch" in status, status
    run_cli("revert", "--python", fake_python, "--series", two_patches, check=0)
    assert b"# 0002\n" not in (site / STATE).read_bytes()
    assert b"patched-by-0001" in (site / API).read_bytes() and b"patched-by-0002" not in (site / API).read_bytes()


def load_first(series):
    return series.without([p.name for p in series.patches[1:]])


def test_every_patch_retired(site, fake_python, one_patch):
    series = load(one_patch)
    current = {p: ((site / p).read_bytes() if (site / p).exists() else None) for p in series.paths}
    _bake_into_base(site, apply_series(series, current))
    before = tree_digest(site)
    out = run_cli("apply", "--python", fake_python, "--series", one_patch, check=0).stdout
    assert "every patch is already in base: retired" in out
    assert tree_digest(site) == before
    status = run_cli("status", "--python", fake_python, "--series", one_patch, check=0).stdout
    assert "retired      0001-add-policy.patch" in status and "every patch is already in base" in status


def test_hand_applied_patch_is_not_retired(site, fake_python, one_patch):
    # Same bytes as above, but RECORD still has the base hashes: applied by hand, not upstream.
    series = load(one_patch)
    current = {p: ((site / p).read_bytes() if (site / p).exists() else None) for p in series.paths}
    for rel, data in apply_series(series, current).items():
        (site / rel).write_bytes(data)
    status = run_cli("status", "--python", fake_python, "--series", one_patch, check=0).stdout
    assert "retired" not in status


def test_retired_by_public_api():
    old = b"class A:\n    pass\n"
    patch = parse_patch("0001-x.patch", unified("m.py", old, old + b"\n\ndef get_fsdp_policy(self):\n    return 1\n")
                        .encode())
    merged_differently = b"class A:\n    x = 1\n\n\ndef get_fsdp_policy(self) -> int:\n    return 2  # reviewed\n"
    assert "public API is already in the base (get_fsdp_policy)" in retired_reason(patch, {"m.py": merged_differently})
    assert retired_reason(patch, {"m.py": old}) is None  # it applies: live
    assert retired_reason(patch, {"m.py": b"class B:\n    pass\n"}) is None  # conflict, not retired
    assert ops.RETIRED == RETIRED == "retired"


def test_patch_without_tracker_is_its_own_pr(pristine_site, stack, tmp_path):
    series, repo = stack
    d = series.directory
    p2 = d / "0002-partial.patch"
    p2.write_text(p2.read_text().replace("Bug: https://github.com/pytorch/pytorch/issues/203176", "Bug: none yet"))
    out = tmp_path / "upstream"
    result = ex.export(load(d), _base_files(pristine_site), out, repo)
    assert [g.key for g in result.groups] == ["203177", "new-0002"]
    pr = (out / "new-0002" / "PR.md").read_text()
    assert "Fixes #" not in pr and "Stacked on #203177" in pr
    assert [line.split("/")[0] for line in (out / "series").read_text().splitlines()
            if not line.startswith("#")] == ["203177", "203177", "new-0002"]
    patch = next((out / "new-0002").glob("*.patch")).read_text()
    assert "Subject: [PATCH] [FSDP2] Add partial" in patch  # no n/m: adding a patch rewrites nothing else


def test_tests_of_a_patch_without_tracker_map_by_name(pristine_site, stack, tmp_path):
    series, repo = stack
    d = series.directory
    p2 = d / "0002-partial.patch"
    p2.write_text(p2.read_text().replace("Bug: https://github.com/pytorch/pytorch/issues/203176",
                                         "Bug: none yet (no tracker yet)"))
    partial_test = "test/distributed/_composable/fsdp/test_partial.py"
    (repo / partial_test).write_text("# Owner(s): [\"oncall: distributed\"]\nimport torch\n")
    with open(d / "manifest.ini", "a") as fh:
        fh.write(f"Partial = [FSDP2] | partial things | {partial_test}\n"
                 "no-such-patch = [FSDP2] | nothing | test/none.py\n")
    result = ex.export(load(d), _base_files(pristine_site), tmp_path / "upstream", repo)
    group = result.groups[1]
    assert group.key == "new-0002" and group.tracker.what == "partial things" and partial_test in group.tests
    assert "Add tests for partial things" in (tmp_path / "upstream" / "new-0002" / next(
        n for n in group.files if "tests" in n)).read_text()
    assert any("no-such-patch: no patch file name contains it" in w for w in result.warnings)
    assert not any("new-0002" in w or "0002-partial.patch (no tracker yet): no line" in w for w in result.warnings)


def test_tracker_sharing_an_earlier_prs_test_file_gets_no_empty_commit(pristine_site, stack, tmp_path):
    # The shipped manifest maps has_pending_gradients and reset_iter_state to one test file.
    series, repo = stack
    manifest = series.directory / "manifest.ini"
    text = manifest.read_text()
    line = next(x for x in text.splitlines() if x.startswith("203176 = "))
    manifest.write_text(text.replace(line, f"203176 = [FSDP2] | partial things | {POLICY_TEST}"))
    out = tmp_path / "upstream"
    result = ex.export(load(series.directory), _base_files(pristine_site), out, repo)
    assert [g.tests_in_earlier_pr for g in result.groups] == [False, True]
    assert any("#203176: its test files are unchanged from an earlier PR" in w for w in result.warnings)
    assert [p.name for p in sorted((out / "203176").glob("*.patch"))] == ["0001-FSDP2-Add-partial.patch"]
    assert "come with an earlier PR of this stack" in (out / "203176" / "PR.md").read_text()


def test_folded_from_header_is_unfolded():
    data = ("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
            "From: A Long Maintainers Name\n <maint@example.com>\nDate: Tue, 1 Dec 2026 03:25:25 +0000\n"
            "Subject: [PATCH] [FSDP2] X\n\nX.\n\n---\n" + unified("m.py", b"a\n", b"b\n")).encode()
    assert parse_patch("0001-x.patch", data).mail_header("From") == "A Long Maintainers Name <maint@example.com>"
