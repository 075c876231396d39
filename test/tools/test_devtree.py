"""tools/devtree.py: init from an installed torch, edit as commits, export."""

import os
import shutil
import subprocess
import sys

import pytest

from tooling import API, REPO, run_cli, tree_digest

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
ENV = dict(os.environ, GIT_AUTHOR_NAME="Dev", GIT_AUTHOR_EMAIL="dev@example.com",
           GIT_COMMITTER_NAME="Dev", GIT_COMMITTER_EMAIL="dev@example.com",
           GIT_AUTHOR_DATE="2026-02-03T04:05:06+0000", GIT_COMMITTER_DATE="2026-02-03T04:05:06+0000")


def devtree(*args, check=0):
    proc = subprocess.run([sys.executable, str(REPO / "tools/devtree.py"), *map(str, args)],
                          capture_output=True, text=True, env=ENV)
    assert proc.returncode == check, proc.stdout + proc.stderr
    return proc


def git(tree, *args):
    return subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True,
                          text=True, env=ENV).stdout


def test_init_edit_export_round_trip(fake_python, site, one_patch, tmp_path):
    tree = tmp_path / "tree"
    devtree("init", tree, "--python", fake_python, "--series", one_patch)
    assert git(tree, "tag").split() == ["base"]
    log = git(tree, "log", "--format=%s", "base..HEAD").splitlines()
    assert log == ["[FSDP2] Add policy"]
    assert "Bug: https://github.com/pytorch/pytorch/issues/203177" in git(tree, "log", "-1", "--format=%B")
    assert (tree / "torch/distributed/pipelining/schedules.py").is_file()

    # export, re-init from the export, export again: byte-identical
    out1 = tmp_path / "out1"
    out1.mkdir()
    devtree("export", tree, "--series", out1)
    assert (out1 / "series").read_text().strip() == "0001-FSDP2-Add-policy.patch"
    text = (out1 / "0001-FSDP2-Add-policy.patch").read_text()
    assert text.startswith("From 0000000000000000000000000000000000000000 ")
    assert "Subject: [PATCH] [FSDP2] Add policy" in text and "Last-Update: 2026-01-01" in text
    tree2 = tmp_path / "tree2"
    devtree("init", tree2, "--python", fake_python, "--series", out1)
    out2 = tmp_path / "out2"
    out2.mkdir()
    devtree("export", tree2, "--series", out2)
    assert tree_digest(out1) == tree_digest(out2)

    # a second commit becomes 0002; the exported series applies with the CLI
    (tree / API).write_bytes((tree / API).read_bytes() + b"# second change\n")
    git(tree, "commit", "-qam", "[FSDP2] Second\n\nBug: https://github.com/pytorch/pytorch/issues/203176\n"
                                "Forwarded: no\nLast-Update: 2026-02-03")
    first = (out1 / "0001-FSDP2-Add-policy.patch").read_bytes()
    devtree("export", tree, "--series", out1)
    names = (out1 / "series").read_text().split()
    assert names == ["0001-FSDP2-Add-policy.patch", "0002-FSDP2-Second.patch"]
    assert "Subject: [PATCH] [FSDP2] Second" in (out1 / names[1]).read_text()
    assert (out1 / names[0]).read_bytes() == first  # adding a patch rewrites no other file
    run_cli("apply", "--python", fake_python, "--series", out1, check=0)
    assert (site / API).read_bytes() == (tree / API).read_bytes()

    # a long subject is cut at a word boundary, not mid-word
    (tree / API).write_bytes((tree / API).read_bytes() + b"# third change\n")
    git(tree, "commit", "-qam", "[FSDP2] Add partial_backward() and finish_forward() for chunked loss\n\n"
                                "Bug: none yet\nForwarded: not-yet\nLast-Update: 2026-02-04")
    devtree("export", tree, "--series", out1)
    assert (out1 / "series").read_text().split()[-1] == "0003-FSDP2-Add-partial_backward-and-finish_forward-for.patch"

    # export refuses a dirty tree; init refuses a non-empty directory
    (tree / API).write_bytes(b"dirty\n")
    assert "uncommitted changes" in devtree("export", tree, "--series", out1, check=1).stderr
    assert "not empty" in devtree("init", tree, "--python", fake_python, check=1).stderr


def test_init_from_patched_torch_uses_pristine_copies(fake_python, site, one_patch, tmp_path):
    run_cli("apply", "--python", fake_python, "--series", one_patch, check=0)
    tree = tmp_path / "tree"
    devtree("init", tree, "--python", fake_python, "--series", one_patch)
    assert git(tree, "diff", "base", "HEAD", "--stat").count("|") == 3


def test_init_refuses_edited_torch(fake_python, site, tmp_path):
    with open(site / API, "ab") as fh:
        fh.write(b"# edited in place\n")
    proc = devtree("init", tmp_path / "tree", "--python", fake_python, check=1)
    assert "does not match its RECORD" in proc.stderr
