#!/usr/bin/env python3
"""Developer workflow: edit the series as git commits, then regenerate it.

    python tools/devtree.py init DIR [--python PY]   # pristine base + series as commits
    ... edit in DIR: git commit / git rebase -i / git commit --amend ...
    python tools/devtree.py export DIR               # rewrite torch_patches/patches/

``init`` copies every ``.py`` under the manifest's ``[base] prefixes``
(``torch/distributed/fsdp/``, ``torch/distributed/pipelining/``) from the
pinned torch installed for PY (if
that torch was patched in place, the pristine copies the patch marker keeps
are used), verifies each against the dist-info RECORD hashes, commits them as
the base commit (tag ``base``), and applies the series with ``git am``.

``export`` runs ``git format-patch --no-signature --zero-commit --full-index
--no-renames --numbered base..HEAD``, renumbers the files ``NNNN-slug.patch``
and rewrites ``series``. Commit messages keep the DEP-3 fields (``Bug:``,
``Forwarded:``, ``Last-Update:``), so they survive the round trip. Author
dates come from the patches, and the base commit has a fixed date, so an
unchanged tree exports byte-identical patches.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torch_patches.errors import TorchPatchesError  # noqa: E402
from torch_patches.installed import pristine_base_files  # noqa: E402
from torch_patches.series import (MANIFEST_NAME, default_series_dir, load_series, parse_patch,  # noqa: E402
                                  read_manifest)

FIXED_DATE = "2000-01-01T00:00:00+0000"


def git(tree: Path, *args: str, env=None, capture=True) -> str:
    """Run git in ``tree``; raise :class:`TorchPatchesError` with its stderr."""
    full_env = dict(os.environ, **(env or {}))
    proc = subprocess.run(["git", "-C", str(tree), *args], capture_output=capture, text=True, env=full_env)
    if proc.returncode != 0:
        raise TorchPatchesError(f"git {' '.join(args)} failed:\n{(proc.stderr or '').strip()}")
    return proc.stdout or ""


def _identity_env(tree: Path) -> dict:
    env = {}
    for key, var, default in (("user.name", "NAME", "torch-patches devtree"),
                              ("user.email", "EMAIL", "devtree@localhost")):
        proc = subprocess.run(["git", "-C", str(tree), "config", key], capture_output=True, text=True)
        if not proc.stdout.strip():
            env[f"GIT_AUTHOR_{var}"] = env[f"GIT_COMMITTER_{var}"] = default
    return env


def cmd_init(args) -> None:
    tree = Path(args.dir).resolve()
    if tree.exists() and any(tree.iterdir()):
        raise TorchPatchesError(f"{tree} exists and is not empty")
    series = load_series(args.series)
    base = series.base
    files = pristine_base_files(args.python, base)
    print(f"init: {len(files)} pristine files from torch {base.version} -> {tree}")
    for rel, data in files.items():
        dest = tree / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
    git(tree, "init", "-q")
    env = _identity_env(tree)
    git(tree, "add", "-A")
    base_env = dict(env, GIT_AUTHOR_DATE=FIXED_DATE, GIT_COMMITTER_DATE=FIXED_DATE)
    if "GIT_AUTHOR_NAME" not in base_env:
        base_env.update(GIT_AUTHOR_NAME="PyTorch", GIT_AUTHOR_EMAIL="packages@pytorch.org")
    git(tree, "commit", "-q", "-m",
        f"torch {base.version} base ({base.git_version[:12]})\n\n"
        f"Pristine {' '.join(base.prefixes)} sources of the torch {base.version} wheel,\n"
        f"verified against its RECORD. Upstream commit {base.git_version}.", env=base_env)
    git(tree, "tag", "base")
    if series.patches:
        patch_paths = [str(series.directory / p.name) for p in series.patches]
        try:
            git(tree, "am", "-q", "--keep-non-patch", "--committer-date-is-author-date", *patch_paths, env=env)
        except TorchPatchesError as exc:
            subprocess.run(["git", "-C", str(tree), "am", "--abort"], capture_output=True)
            raise TorchPatchesError(f"the series does not apply with git am: {exc}")
    print(git(tree, "log", "--oneline", "--decorate", "-n", str(len(series.patches) + 1)).rstrip())
    print(f"init: edit in {tree}, commit, then `python tools/devtree.py export {args.dir}`")


def cmd_export(args) -> None:
    tree = Path(args.dir).resolve()
    out_dir = Path(args.series) if args.series else default_series_dir()
    if git(tree, "status", "--porcelain", "--untracked-files=no").strip():
        raise TorchPatchesError(f"{tree} has uncommitted changes; commit or stash them first")
    with tempfile.TemporaryDirectory() as tmp:
        git(tree, "format-patch", "-q", "--no-signature", "--zero-commit", "--full-index", "--no-renames",
            "--numbered", "-o", tmp, "base..HEAD")
        new = sorted(Path(tmp).glob("*.patch"))
        for p in new:
            patch = parse_patch(p.name, p.read_bytes())
            missing = patch.missing_dep3()
            if missing:
                print(f"warning: {p.name} lacks DEP-3 field(s) {', '.join(missing)} in its commit message")
        header = []
        series_file = out_dir / "series"
        if series_file.exists():
            for line in series_file.read_text().splitlines():
                if not line.startswith("#"):
                    break
                header.append(line)
            for line in series_file.read_text().splitlines():
                name = line.split("#", 1)[0].strip()
                if name and (out_dir / name).exists():
                    (out_dir / name).unlink()
        out_dir.mkdir(parents=True, exist_ok=True)
        if not (out_dir / MANIFEST_NAME).is_file():
            shutil.copyfile(default_series_dir() / MANIFEST_NAME, out_dir / MANIFEST_NAME)
            print(f"export: {out_dir} had no {MANIFEST_NAME}; copied the shipped one")
        for p in new:
            shutil.copyfile(p, out_dir / p.name)
        series_file.write_text("\n".join(header + [p.name for p in new]) + "\n")
    print(f"export: {len(new)} patch(es) -> {out_dir}")
    for p in new:
        print(f"  {p.name}")
    print(f"export: bump [series] revision in {out_dir / 'manifest.ini'} "
          f"(now {read_manifest(out_dir).revision}) when releasing a changed series")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="devtree", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("init", help="materialise an editable git tree of the base + series")
    p.add_argument("dir")
    p.add_argument("--python", metavar="PY", help="interpreter with the pinned torch (default: this one)")
    p.add_argument("--series", metavar="DIR", help="series to apply (default: the shipped one)")
    p.set_defaults(func=cmd_init)
    p = sub.add_parser("export", help="regenerate the patch files and series from base..HEAD")
    p.add_argument("dir")
    p.add_argument("--series", metavar="DIR", help="series directory to rewrite (default: the shipped one)")
    p.set_defaults(func=cmd_export)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except TorchPatchesError as exc:
        print(f"devtree {args.command}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
