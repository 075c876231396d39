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

``export`` runs ``git format-patch`` (the flags of
:mod:`torch_patches.upstream.gitstack`) on ``base..HEAD``, names the files
``NNNN-slug.patch`` (slugs cut at a word boundary) and rewrites ``series``
(keeping its comment header; the ``manifest.ini`` beside it is left alone).
Commit messages keep the DEP-3 fields (``Bug:``,
``Forwarded:``, ``Last-Update:``), so they survive the round trip. Author
dates come from the patches, and the base commit has a fixed date, so an
unchanged tree exports byte-identical patches.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torch_patches.errors import TorchPatchesError  # noqa: E402
from torch_patches.series import (MANIFEST_NAME, default_series_dir, load_series,  # noqa: E402
                                  parse_patch, read_manifest, read_series_file, write_series_file)
from torch_patches.targets.pristine import pristine_base_files  # noqa: E402
from torch_patches.upstream.gitstack import am, format_patch, git, init_base  # noqa: E402


def cmd_init(args) -> None:
    tree = Path(args.dir).resolve()
    if tree.exists() and any(tree.iterdir()):
        raise TorchPatchesError(f"{tree} exists and is not empty")
    series = load_series(args.series)
    files = pristine_base_files(series, args.python, args.source)
    print(f"init: {len(files)} pristine files from torch {series.base.version} -> {tree}")
    init_base(tree, files, series.base)
    if series.patches:
        am(tree, [p.data for p in series.patches], "the series")
    print(git(tree, "log", "--oneline", "--decorate", "-n", str(len(series.patches) + 1)).rstrip())
    print(f"init: edit in {tree}, commit, then `python tools/devtree.py export {args.dir}`")


def cmd_export(args) -> None:
    tree = Path(args.dir).resolve()
    out_dir = Path(args.series) if args.series else default_series_dir()
    if git(tree, "status", "--porcelain", "--untracked-files=no").strip():
        raise TorchPatchesError(f"{tree} has uncommitted changes; commit or stash them first")
    with tempfile.TemporaryDirectory() as tmp:
        new = format_patch(tree, "base..HEAD", Path(tmp))
        for p in new:
            missing = parse_patch(p.name, p.read_bytes()).missing_dep3()
            if missing:
                print(f"warning: {p.name} lacks DEP-3 field(s) {', '.join(missing)} in its commit message")
        header: tuple = ()
        if (out_dir / "series").exists():
            old = read_series_file(out_dir)
            header = old.header
            for name in old.names:
                (out_dir / name).unlink(missing_ok=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        if not (out_dir / MANIFEST_NAME).is_file():
            shutil.copyfile(default_series_dir() / MANIFEST_NAME, out_dir / MANIFEST_NAME)
            print(f"export: {out_dir} had no {MANIFEST_NAME}; copied the shipped one")
        for p in new:
            shutil.copyfile(p, out_dir / p.name)
        write_series_file(out_dir, header, [p.name for p in new])
    print(f"export: {len(new)} patch(es) -> {out_dir}")
    for p in new:
        print(f"  {p.name}")
    print(f"export: bump [series] revision in {out_dir / MANIFEST_NAME} "
          f"(now {read_manifest(out_dir).revision}) when releasing a changed series")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="devtree", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("init", help="materialise an editable git tree of the base + series")
    p.add_argument("dir")
    p.add_argument("--python", metavar="PY", help="interpreter with the pinned torch (default: this one)")
    p.add_argument("--series", metavar="DIR", help="series to apply (default: the shipped one)")
    p.add_argument("--source", metavar="DIR", help="source checkout of the base, for files an installed torch "
                   "does not hold (docs/) that the series changes")
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
