"""Helpers and fixtures for the tooling tests: fake site-packages, source trees, series.

The "real" files come from the pinned torch installed for the interpreter
running the tests (found without importing torch). If that torch was patched
in place (``tools/run_tests.sh`` does that), the snapshot is reverted to the
pristine files first, using the tool's own revert.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
import shutil
import stat
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from torch_patches import ops  # noqa: E402
from torch_patches.targets.installed import InstalledTorch, run_locate  # noqa: E402
from torch_patches.patching import git_blob_id  # noqa: E402
from torch_patches.series import MANIFEST_NAME, default_series_dir, read_manifest  # noqa: E402

TOUCHED_DIRS = ("torch/distributed/fsdp", "torch/distributed/pipelining")
API = "torch/distributed/fsdp/_fully_shard/_fsdp_api.py"
STATE = "torch/distributed/fsdp/_fully_shard/_fsdp_state.py"
FSDP_INIT = "torch/distributed/fsdp/__init__.py"
NEW_FILE = "torch/distributed/fsdp/_fully_shard/_fsdp_lifecycle.py"

#: The shipped series directory and its manifest (the base every fixture copies).
SHIPPED = default_series_dir()
MANIFEST = read_manifest(SHIPPED)
BASE = MANIFEST.base
REVISION = MANIFEST.revision
DI = f"torch-{BASE.version}.dist-info"


def _copy_snapshot(site: Path, dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "licenses")
    for rel in TOUCHED_DIRS:
        shutil.copytree(site / rel, dest / rel, ignore=ignore)
    shutil.copy2(site / "torch/version.py", dest / "torch/version.py")
    (dest / "torch/__init__.py").write_bytes(b"")
    for di in site.glob("torch-*.dist-info"):
        shutil.copytree(di, dest / di.name, ignore=ignore)


@pytest.fixture(scope="session")
def pristine_site(tmp_path_factory) -> Path:
    """A pristine minimal site-packages copied from the installed torch."""
    python = os.environ.get("TORCH_PATCHES_TEST_PYTHON", sys.executable)
    info = run_locate(python)
    if not info.get("torch_init"):
        pytest.skip(f"no torch installed for {python}; set TORCH_PATCHES_TEST_PYTHON")
    site = Path(info["torch_init"]).parent.parent
    dest = tmp_path_factory.mktemp("pristine") / "site-packages"
    _copy_snapshot(site, dest)
    fake = InstalledTorch(python, {**info, "torch_init": str(dest / "torch/__init__.py")})
    if fake.kind == "wheel":
        pytest.skip("the test interpreter's torch comes from a patched wheel; use a base torch")
    problem = fake.base_problem(BASE)
    if problem:
        pytest.skip(problem)
    if fake.load_marker() is not None:
        ops.revert(fake, load(empty_series_dir(tmp_path_factory.mktemp("s"))))
    rels = [str(p.relative_to(dest)) for rel in TOUCHED_DIRS for p in (dest / rel).rglob("*.py")]
    problems = fake.verify_pristine(fake.read_all(rels))
    if problems:
        pytest.skip(f"the torch of {python} was edited in place without torch_patches "
                    f"({problems[0]}); point TORCH_PATCHES_TEST_PYTHON at a pristine torch {BASE.version}")
    return dest


@pytest.fixture
def site(pristine_site, tmp_path) -> Path:
    dest = tmp_path / "site-packages"
    shutil.copytree(pristine_site, dest)
    return dest


def python_wrapper(site: Path, wrapper: Path) -> str:
    """Write ``wrapper``, an interpreter whose imports find ``site`` first; return its path."""
    wrapper.parent.mkdir(parents=True, exist_ok=True)
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.fixture
def fake_python(site, tmp_path) -> str:
    """An interpreter wrapper whose ``import torch`` finds the fake ``site``."""
    return python_wrapper(site, tmp_path / "bin" / "python")


@pytest.fixture
def source_tree(pristine_site, tmp_path) -> Path:
    """A synthetic PyTorch source tree: installed files at repo paths + version.txt."""
    dest = tmp_path / "pytorch"
    for rel in TOUCHED_DIRS:
        shutil.copytree(pristine_site / rel, dest / rel)
    shutil.copy2(pristine_site / "torch/version.py", dest / "torch/version.py")
    (dest / "version.txt").write_text(BASE.version + "\n")
    return dest


def load(directory):
    from torch_patches.series import load_series
    return load_series(directory)


def write_manifest(directory: Path, revision=None, version=None, git_version=None) -> Path:
    """Copy the shipped ``manifest.ini`` into ``directory``, optionally with another
    revision or base (``version``/``git_version``)."""
    text = (SHIPPED / MANIFEST_NAME).read_text()
    for key, value in (("revision", revision), ("version", version), ("git_version", git_version)):
        if value is not None:
            text = re.sub(rf"(?m)^{key} = .*$", f"{key} = {value}", text, count=1)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST_NAME).write_text(text)
    return directory


def empty_series_dir(directory: Path) -> Path:
    write_manifest(directory)
    (directory / "series").write_text("# empty\n")
    return directory


def unified(path: str, old, new) -> str:
    """A git-style diff of one file (``None`` = absent)."""
    a = old.decode().splitlines(keepends=True) if old is not None else []
    b = new.decode().splitlines(keepends=True) if new is not None else []
    body = "".join(difflib.unified_diff(a, b, "a/" + path if old is not None else "/dev/null",
                                        "b/" + path if new is not None else "/dev/null", lineterm="\n"))
    body = body.replace("--- a/", "--- a/", 1)
    header = f"diff --git a/{path} b/{path}\n"
    if old is None:
        header += "new file mode 100644\n"
    if new is None:
        header += "deleted file mode 100644\n"
    old_blob = git_blob_id(old)[:12] if old is not None else "0" * 12
    new_blob = git_blob_id(new)[:12] if new is not None else "0" * 12
    header += f"index {old_blob}..{new_blob}" + (" 100644\n" if old is not None and new is not None else "\n")
    lines = body.splitlines(keepends=True)
    # difflib puts "--- " and "+++ " first; the header goes before them.
    return header + "".join(lines)


def write_patch(directory: Path, name: str, subject: str, diffs: str, dep3: bool = True) -> Path:
    fields = textwrap.dedent("""\
        Bug: https://github.com/pytorch/pytorch/issues/203177
        Forwarded: not-needed
        Last-Update: 2026-01-01
        """) if dep3 else ""
    text = (f"From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
            f"From: Test <test@example.com>\nDate: Thu, 1 Jan 2026 00:00:00 +0000\n"
            f"Subject: [PATCH 1/1] [FSDP2] {subject}\n\n{subject}.\n\n{fields}---\n{diffs}")
    path = directory / name
    path.write_text(text)
    return path


def write_series(directory: Path, names, revision=None) -> Path:
    write_manifest(directory, revision=revision)
    (directory / "series").write_text("# test series\n" + "".join(n + "\n" for n in names))
    return directory


def edit(data: bytes, marker: str) -> bytes:
    """Insert a marker comment after the first line of ``data``."""
    first, rest = data.split(b"\n", 1)
    return first + b"\n# " + marker.encode() + b"\n" + rest


@pytest.fixture
def one_patch(pristine_site, tmp_path) -> Path:
    """A one-patch series editing two real files and creating a new one."""
    d = tmp_path / "series1"
    d.mkdir()
    api = (pristine_site / API).read_bytes()
    init = (pristine_site / FSDP_INIT).read_bytes()
    diffs = unified(API, api, edit(api, "patched-by-0001")) + unified(
        FSDP_INIT, init, init + b"# patched-by-0001\n") + unified(NEW_FILE, None, b"X = 1\n")
    write_patch(d, "0001-add-policy.patch", "Add policy", diffs)
    return write_series(d, ["0001-add-policy.patch"])


@pytest.fixture
def two_patches(pristine_site, tmp_path) -> Path:
    """Two patches: 0001 edits _fsdp_api.py, 0002 edits it again and _fsdp_state.py."""
    d = tmp_path / "series2"
    d.mkdir()
    api = (pristine_site / API).read_bytes()
    api1 = edit(api, "patched-by-0001")
    state = (pristine_site / STATE).read_bytes()
    write_patch(d, "0001-first.patch", "First", unified(API, api, api1))
    write_patch(d, "0002-second.patch", "Second",
                unified(API, api1, api1 + b"# patched-by-0002\n") + unified(STATE, state, edit(state, "0002")))
    return write_series(d, ["0001-first.patch", "0002-second.patch"])


def tree_digest(root: Path) -> dict:
    """``{relative path: (sha256, mode)}`` of every file under ``root``."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            out[str(p.relative_to(root))] = (hashlib.sha256(p.read_bytes()).hexdigest(),
                                             stat.S_IMODE(p.stat().st_mode))
    return out


def run_cli(*args, check=None, env=None, replace_env=False, cwd=None):
    """Run ``python -m torch_patches ARGS`` in a subprocess (in directory ``cwd``); return the
    CompletedProcess.

    ``env`` adds to this process's environment, or with ``replace_env`` is the whole of it."""
    import subprocess
    env = dict({} if replace_env else os.environ, **(env or {}), PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "torch_patches", *map(str, args)],
                          capture_output=True, text=True, env=env, cwd=cwd)
    if check is not None:
        assert proc.returncode == check, (proc.returncode, proc.stdout, proc.stderr)
    return proc
