"""What every verb shares: paths that start from the user's directory, and help that is complete.

Each path argument is given relative to the directory the command runs in (not
the repository, not the interpreter's), in the spellings users type:
``.venv/bin/python``, ``./.venv/bin/python``, ``../bin/python``, a venv directory.
"""

import argparse
import os
import shutil
import subprocess
import sys

import pytest

from test_consumers import _series as consumer_series
from test_consumers import _site as consumer_site
from test_devtree import ENV as GIT_ENV
from test_export import stack  # noqa: F401  (two trackers and a checkout with their tests)
from test_wheel import base_wheel  # noqa: F401  (the small base wheel fixture)
from tooling import BASE, REPO, REVISION, python_wrapper, run_cli, tree_digest
from torch_patches.cli import build_parser
from torch_patches.fsutil import resolve_python

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")


@pytest.fixture
def project(site, fake_python, tmp_path):
    """``tmp_path/project``: the directory commands run in, with ``.venv/bin/python`` (its torch
    is ``site``); ``fake_python`` is ``../bin/python`` from there (so ``..`` is a venv too)."""
    cwd = tmp_path / "project"
    python_wrapper(site, cwd / ".venv" / "bin" / "python")
    return cwd


def test_relative_python_in_every_spelling(site, project, one_patch):
    series = os.path.relpath(one_patch, project)
    for python in (".venv/bin/python", "./.venv/bin/python", ".venv", "./.venv/", "../bin/python", ".."):
        proc = run_cli("status", "--python", python, "--series", series, cwd=project)
        assert proc.returncode == 0, (python, proc.stderr)
        assert "pinned base: yes" in proc.stdout and "state:       not applied" in proc.stdout, (python, proc.stdout)
    # and from a subdirectory, the same interpreter one level further up
    sub = project / "sub"
    sub.mkdir()
    proc = run_cli("status", "--python", "../.venv", "--series", "../" + series, cwd=sub)
    assert proc.returncode == 0 and str(site / "torch") in proc.stdout, proc.stderr
    # what is not there is named as the user wrote it, from the user's directory
    proc = run_cli("status", "--python", "../venv/bin/python", "--series", series, cwd=project)
    assert proc.returncode == 1 and f"no such interpreter: {project.parent / 'venv/bin/python'}" in proc.stderr


def test_apply_revert_check_relative(site, project, one_patch, source_tree):
    series = os.path.relpath(one_patch, project)
    before = tree_digest(site)
    out = run_cli("apply", "--python", ".venv", "--series", series, cwd=project, check=0).stdout
    assert out.startswith(f"applied series revision {REVISION}"), out
    assert "state:       applied" in run_cli("status", "--python", "./.venv/bin/python", "--series", series,
                                             cwd=project, check=0).stdout
    run_cli("revert", "--python", "../bin/python", "--series", series, cwd=project, check=0)
    assert tree_digest(site) == before
    out = run_cli("check", "--source", os.path.relpath(source_tree, project), "--series", series,
                  cwd=project, check=0).stdout
    assert "ok: apply would succeed" in out


def test_wheel_fetch_manifest_relative(project, one_patch, base_wheel, tmp_path):  # noqa: F811
    series = os.path.relpath(one_patch, project)
    base = os.path.relpath(base_wheel, project)
    out = run_cli("wheel", "--base", base, "-o", "out/dist", "--series", series, cwd=project, check=0).stdout
    assert len(list((project / "out/dist").glob("*.whl"))) == 1 and "wrote out/dist/torch-" in out
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(base_wheel, cache / base_wheel.name)
    env = {"TORCH_PATCHES_CACHE": str(cache)}
    out = run_cli("fetch", "--python", ".venv", "--series", series, cwd=project, env=env, check=0).stdout
    assert out.strip() == str(cache / base_wheel.name)
    run_cli("wheel", "--python", "./.venv/bin/python", "-o", "dist2", "--series", series, cwd=project, env=env,
            check=0)
    assert len(list((project / "dist2").glob("*.whl"))) == 1
    out = run_cli("manifest", "--series", series, "--get", "revision", cwd=project, check=0).stdout
    assert out.strip() == str(REVISION)


@needs_git
def test_export_and_devtree_relative(project, stack, one_patch):  # noqa: F811
    series, repo = stack
    out = run_cli("export", "-o", "up", "--python", ".venv", "--repo", os.path.relpath(repo, project),
                  "--series", os.path.relpath(series.directory, project), cwd=project, check=0).stdout
    assert "export: 3 patch(es) for 2 PR(s)" in out and (project / "up" / "series").is_file()
    proc = subprocess.run([sys.executable, str(REPO / "tools/devtree.py"), "init", "tree", "--python", ".venv/bin/python",
                           "--series", os.path.relpath(one_patch, project)],
                          cwd=project, capture_output=True, text=True, env=GIT_ENV)
    assert proc.returncode == 0 and (project / "tree" / ".git").is_dir(), proc.stdout + proc.stderr


def test_torchtitan_relative(tmp_path):
    site = consumer_site(tmp_path)
    series = consumer_series(tmp_path)
    cwd = tmp_path / "project"
    python_wrapper(site, cwd / "venv" / "bin" / "python")
    before = tree_digest(site)
    args = ("--series", os.path.relpath(series, cwd))
    for python, action in (("venv", "apply"), ("./venv/bin/python", "status"), ("venv/bin/python", "revert")):
        proc = run_cli("torchtitan", action, "--python", python, *args, cwd=cwd)
        assert proc.returncode == 0, (action, proc.stderr)
    assert tree_digest(site) == before


def test_resolve_python_keeps_names_and_symlinks(tmp_path):
    assert resolve_python("python3") == "python3"  # a bare name: PATH lookup, as in a shell
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    assert resolve_python(str(venv)) == str(venv / "bin" / "python")  # not the symlink's target


def _verbs():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


def test_every_verb_has_a_description_and_exit_codes():
    verbs = _verbs()
    assert {"status", "apply", "revert", "check", "wheel", "fetch", "export", "torchtitan", "manifest"} <= set(verbs)
    for verb in verbs:
        out = run_cli(verb, "--help", check=0, env={"COLUMNS": "100"}).stdout
        description = out.split("\n\n")[1]
        assert not description.startswith(("options:", "positional arguments:")) and len(description) > 60, \
            (verb, out)
        codes = out.split("exit status:\n", 1)[1]
        for code in ("0", "1", "2"):
            assert f"\n  {code}  " in "\n" + codes, (verb, codes)
        if verb in ("apply", "revert", "check", "wheel", "torchtitan"):
            assert "\n  3  refused" in codes, (verb, codes)
        if "positional arguments:\n" in out:  # each says what it is, e.g. torchtitan's {status,apply,...}
            section = out.split("positional arguments:\n", 1)[1].split("\n\n", 1)[0].splitlines()
            for i, line in enumerate(section):
                if not line.startswith(" " * 6):
                    assert len(line.split()) > 1 or section[i + 1:i + 2][0].startswith(" " * 20), (verb, line)
        if "--python PY" in out:
            help_text = " ".join(out.split("--python PY", 2)[-1].split()[:30])
            assert "virtual environment's directory" in help_text, (verb, help_text)


def test_version_names_the_series_it_carries():
    out = run_cli("--version", check=0).stdout
    assert out.startswith("torch-patches ")
    assert f"series: revision {REVISION}, " in out and f"for torch {BASE.short}" in out
    assert f"wheel version {BASE.patched_version(REVISION, '<base label>')}" in out
