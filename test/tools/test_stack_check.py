"""export --check-stack: each PR's tests on a copy of a pristine venv with only PRs 1..k; apply --upto."""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tooling import API, STATE, edit, load, run_cli, tree_digest, unified, write_patch, write_series
from torch_patches import ops, stackcheck
from torch_patches.series import read_manifest

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
POLICY_TEST = "test/distributed/_composable/fsdp/test_fully_shard_policy.py"  # 203177 in [trackers]
LIFECYCLE_TEST = "test/distributed/_composable/fsdp/test_fully_shard_lifecycle.py"  # 203176

TESTS = textwrap.dedent('''\
    from pathlib import Path

    import torch

    FSDP = Path(torch.__file__).parent / "distributed/fsdp/_fully_shard"


    def test_policy_applied():
        assert "patched-by-0001" in (FSDP / "_fsdp_api.py").read_text()


    def test_partial_not_applied_yet():
        assert "# 0002" not in (FSDP / "_fsdp_state.py").read_text()
    ''')
LATER = textwrap.dedent('''\
    from pathlib import Path

    import torch


    def test_partial_applied():
        fsdp = Path(torch.__file__).parent / "distributed/fsdp/_fully_shard"
        assert "# 0002" in (fsdp / "_fsdp_state.py").read_text()
    ''')


@pytest.fixture
def series(pristine_site, tmp_path):
    """0001 (#203177) marks _fsdp_api.py, 0002 (#203176) _fsdp_state.py."""
    d = tmp_path / "series"
    d.mkdir()
    api, state = (pristine_site / API).read_bytes(), (pristine_site / STATE).read_bytes()
    write_patch(d, "0001-policy.patch", "Add policy", unified(API, api, edit(api, "patched-by-0001")))
    p2 = write_patch(d, "0002-partial.patch", "Add partial", unified(STATE, state, edit(state, "0002")))
    p2.write_text(p2.read_text().replace("issues/203177", "issues/203176"))
    return write_series(d, ["0001-policy.patch", "0002-partial.patch"])


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "repo"
    for rel, text in ((POLICY_TEST, TESTS), (LIFECYCLE_TEST, LATER)):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    return repo


@pytest.fixture
def venv(pristine_site, tmp_path):
    """A real venv (no pip) whose site-packages holds the pristine torch snapshot; pytest
    comes from this interpreter's site-packages through a .pth file (after the snapshot)."""
    root = tmp_path / "venvs" / "pristine"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = next(root.glob("lib/python3*/site-packages"))
    shutil.copytree(pristine_site, site, dirs_exist_ok=True)
    (site / "pytest-here.pth").write_text(str(Path(pytest.__file__).parent.parent) + "\n")
    return root


def test_each_pr_runs_its_tests_with_only_the_prs_below_it(series, repo, venv, tmp_path):
    before = tree_digest(venv)
    out = tmp_path / "upstream"
    proc = run_cli("export", "-o", out, "--series", series, "--repo", repo, "--check-stack", venv, check=0)
    assert "[1/2] 203177: patches 1..1 (0001), 1 test file(s) ..." in proc.stdout
    assert "[1/2] 203177: 2 tests, 2 passed, 0 failed, 0 skipped in" in proc.stdout
    assert "[2/2] 203176: 1 tests, 1 passed" in proc.stdout
    assert "stack check: 2 of 2 PR(s) pass on their own" in proc.stdout
    assert tree_digest(venv) == before  # the copies never write into the venv
    assert [p.name for p in venv.parent.iterdir()] == ["pristine"]  # and are gone

    recorded = json.loads((out / "stack-check.json").read_text())
    assert recorded["command"].startswith("python -m torch_patches export -o ")
    assert [(pr["key"], pr["upto"], pr["run"], pr["passed"]) for pr in recorded["prs"]] == [
        ("203177", 1, 2, 2), ("203176", 2, 1, 1)]
    pr = (out / "203177" / "PR.md").read_text()
    plan = pr.split("## Test Plan", 1)[1]
    assert "with only this PR and the ones below it (patches 1-1 of series revision" in plan
    assert f"`pytest {POLICY_TEST}`" in plan and "**2 tests, 2 passed, 0 failed, 0 skipped in" in plan
    assert "Made by `python -m torch_patches export" in plan
    assert "Not run by the export" not in plan  # the stack check ran it

    # The committed results are shown again without re-running; changed test bytes are stale.
    (repo / LIFECYCLE_TEST).write_text(LATER + "\n")
    run_cli("export", "-o", out, "--series", series, "--repo", repo, "--python", venv,
            "--stack-results", out / "stack-check.json", check=0)
    assert "**2 tests, 2 passed" in (out / "203177" / "PR.md").read_text()
    assert "**Stack check stale:**" in (out / "203176" / "PR.md").read_text()


def test_recheck_runs_only_the_named_prs_and_keeps_the_others(series, repo, venv, tmp_path):
    out = tmp_path / "upstream"
    run_cli("export", "-o", out, "--series", series, "--repo", repo, "--check-stack", venv, check=0)
    first = json.loads((out / "stack-check.json").read_text())
    (repo / LIFECYCLE_TEST).write_text(LATER + "\n\ndef test_more():\n    pass\n")
    proc = run_cli("export", "-o", out, "--series", series, "--repo", repo, "--check-stack", venv,
                   "--recheck", "203176", check=0)
    assert "[1/1] 203176: 2 tests, 2 passed" in proc.stdout and "] 203177:" not in proc.stdout
    second = json.loads((out / "stack-check.json").read_text())
    assert second["prs"][0] == first["prs"][0]  # kept as recorded, with its own command
    assert second["prs"][1]["run"] == 2 and "--recheck 203176" in second["prs"][1]["command"]
    assert "**Stack check stale:**" not in (out / "203176" / "PR.md").read_text()
    proc = run_cli("export", "-o", out, "--series", series, "--repo", repo, "--check-stack", venv,
                   "--recheck", "203999", check=1)
    assert "--recheck 203999: no such PR in the stack; its PRs are 203177, 203176" in proc.stderr


def test_a_test_that_needs_a_later_pr_fails_its_pr(series, repo, venv, tmp_path):
    (repo / POLICY_TEST).write_text(TESTS + "\n\n" + LATER.split("\n\n\n", 1)[1])
    out = tmp_path / "upstream"
    proc = run_cli("export", "-o", out, "--series", series, "--repo", repo, "--check-stack", venv, check=1)
    assert "[1/2] 203177: FAILED (pytest exit 1): 3 tests, 2 passed, 1 failed" in proc.stdout
    assert "failed: test.distributed._composable.fsdp.test_fully_shard_policy::test_partial_applied" \
        in proc.stdout
    assert "FAILED: #203177" in proc.stdout
    assert "- `test.distributed._composable.fsdp.test_fully_shard_policy::test_partial_applied`" in (
        out / "203177" / "PR.md").read_text()


def test_bad_venv_is_refused_and_nothing_is_written(series, repo, venv, fake_python, tmp_path):
    out = tmp_path / "upstream"
    bad = tmp_path / "venvs" / "nope"
    proc = run_cli("export", "-o", out, "--series", series, "--repo", repo, "--check-stack", bad, check=1)
    assert "no such interpreter or venv" in proc.stderr and "Traceback" not in proc.stderr
    # Not a venv of its own: the fake interpreter's torch is outside its sys.prefix.
    proc = run_cli("export", "-o", out, "--series", series, "--repo", repo, "--check-stack", fake_python)
    assert proc.returncode == 1 and "--check-stack" in proc.stderr and "Traceback" not in proc.stderr
    # The series applied (not pristine), then another torch.
    python = str(venv / "bin" / "python")
    target = stackcheck.InstalledTorch(python, stackcheck.run_locate(python))
    ops.apply(target, load(series))
    proc = run_cli("export", "-o", out, "--series", series, "--repo", repo, "--check-stack", venv, check=1)
    assert "series revision" in proc.stderr and "is applied to its torch" in proc.stderr
    ops.revert(target, load(series))
    version_py = next(venv.glob("lib/python3*/site-packages/torch/version.py"))
    version_py.write_text(version_py.read_text().replace("d0f2af8b66b20da4baa50644c0cd3f887a2eae2e", "1" * 40))
    proc = run_cli("export", "-o", out, "--series", series, "--repo", repo, "--check-stack", venv, check=3)
    assert "is not the pinned base torch" in proc.stderr
    assert not out.exists()


def test_apply_upto_applies_a_prefix_and_reverts(site, fake_python, series):
    before = tree_digest(site)
    assert run_cli("apply", "--upto", "1", "--python", fake_python, "--series", series, check=0).stdout.strip() \
        == f"applied series revision {read_manifest(series).revision}: 1 patch"
    assert "patched-by-0001" in (site / API).read_text() and "# 0002" not in (site / STATE).read_text()
    status = run_cli("status", "--python", fake_python, "--series", series, check=0).stdout
    assert "the first 1 patch of this series are applied (`apply --upto 1`); `apply` adds the other 1" in status
    run_cli("apply", "--python", fake_python, "--series", series, check=0)  # the rest, in one step
    assert "# 0002" in (site / STATE).read_text()
    run_cli("revert", "--python", fake_python, "--series", series, check=0)
    assert tree_digest(site) == before
    proc = run_cli("apply", "--upto", "3", "--python", fake_python, "--series", series, check=2)  # bad usage
    assert "--upto 3: the series has 2 patch(es)" in proc.stderr and tree_digest(site) == before
