"""Source-tree target: apply/check/revert, git HEAD check, the CMake target."""

import os
import shutil
import subprocess
import sys

import pytest

from tooling import API, BASE, NEW_FILE, REPO, REVISION, empty_series_dir, run_cli, tree_digest

MARKER = ".torch_patches.json"


def test_source_round_trip(source_tree, one_patch):
    before = tree_digest(source_tree)
    out = run_cli("check", "--source", source_tree, "--series", one_patch, check=0).stdout
    assert "applies cleanly" in out and "ok: apply would succeed" in out
    assert tree_digest(source_tree) == before  # check is a dry run
    run_cli("apply", "--source", source_tree, "--series", one_patch, check=0)
    assert (source_tree / NEW_FILE).is_file() and (source_tree / MARKER).is_file()
    assert "already applied" in run_cli("apply", "--source", source_tree, "--series", one_patch, check=0).stdout
    out = run_cli("check", "--source", source_tree, "--series", one_patch, check=0).stdout
    assert "applied" in out and "ok: already applied" in out
    run_cli("revert", "--source", source_tree, "--series", one_patch, check=0)
    assert tree_digest(source_tree) == before


def test_source_without_marker_is_recognised(source_tree, one_patch):
    run_cli("apply", "--source", source_tree, "--series", one_patch, check=0)
    (source_tree / MARKER).unlink()  # e.g. a tree patched by a colleague's tarball
    assert "already applied" in run_cli("apply", "--source", source_tree, "--series", one_patch, check=0).stdout
    (source_tree / MARKER).unlink()
    run_cli("revert", "--source", source_tree, "--series", one_patch, check=0)
    assert not (source_tree / NEW_FILE).exists()


def test_source_wrong_version(source_tree, one_patch):
    (source_tree / "version.txt").write_text("2.16.0a0\n")
    before = tree_digest(source_tree)
    for cmd in ("apply", "check"):
        out = run_cli(cmd, "--source", source_tree, "--series", one_patch)
        assert out.returncode == 3 and f"not the pinned base {BASE.version}" in out.stderr
    assert tree_digest(source_tree) == before


def test_source_conflict_reported_per_patch(source_tree, one_patch):
    api = source_tree / API
    api.write_bytes(api.read_bytes().replace(b"# mypy: allow-untyped-defs\n", b"# edited\n", 1))
    before = tree_digest(source_tree)
    out = run_cli("check", "--source", source_tree, "--series", one_patch)
    assert out.returncode == 1 and "conflicts" in out.stdout and "does not apply" in out.stderr
    assert tree_digest(source_tree) == before


def test_source_other_blob_refused(source_tree, one_patch):
    # Same hunks apply, but the file is not the v2.15.0 blob named by the patch.
    init = source_tree / "torch/distributed/fsdp/__init__.py"
    init.write_bytes(b"# local\n" + init.read_bytes())
    before = tree_digest(source_tree)
    out = run_cli("apply", "--source", source_tree, "--series", one_patch)
    assert out.returncode == 1 and "the series expects" in out.stderr
    assert tree_digest(source_tree) == before


def _git(tree, *args):
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@e", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@e")
    subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True, env=env)


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_git_checkout_must_be_pinned_commit(source_tree, one_patch):
    _git(source_tree, "init", "-q")
    _git(source_tree, "add", "-A")
    _git(source_tree, "commit", "-qm", "not the base")
    out = run_cli("apply", "--source", source_tree, "--series", one_patch)
    assert out.returncode == 3 and "git -C" in out.stderr and f"checkout v{BASE.version}" in out.stderr


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")
def test_cmake_apply_target(source_tree, one_patch, tmp_path):
    build = tmp_path / "build"
    configure = ["cmake", "-S", str(REPO), "-B", str(build), f"-DPYTORCH_SOURCE_DIR={source_tree}",
                 f"-DTORCH_PATCHES_SERIES={one_patch}", f"-DPython3_EXECUTABLE={sys.executable}"]
    subprocess.run(configure, check=True, capture_output=True)
    out = subprocess.run(["cmake", "--build", str(build), "--target", "apply_patches"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"applied series revision {REVISION}: 1 patch" in out.stdout
    patched = tree_digest(source_tree)
    assert b"patched-by-0001" in (source_tree / API).read_bytes()
    subprocess.run(configure, check=True, capture_output=True)  # reconfigure
    out = subprocess.run(["cmake", "--build", str(build)], capture_output=True, text=True)
    assert out.returncode == 0 and "already applied" in out.stdout, out.stdout + out.stderr
    assert tree_digest(source_tree) == patched
    out = subprocess.run(["cmake", "--build", str(build), "--target", "check_patches"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "ok: already applied" in out.stdout
    tests = subprocess.run(["ctest", "--test-dir", str(build), "-N"], capture_output=True, text=True)
    assert "test_suite" in tests.stdout


def test_empty_series_source(source_tree, tmp_path):
    series = empty_series_dir(tmp_path / "empty")
    before = tree_digest(source_tree)
    run_cli("check", "--source", source_tree, "--series", series, check=0)
    run_cli("apply", "--source", source_tree, "--series", series, check=0)
    assert "already applied" in run_cli("apply", "--source", source_tree, "--series", series, check=0).stdout
    run_cli("revert", "--source", source_tree, "--series", series, check=0)
    assert tree_digest(source_tree) == before
