"""Command line: ``python -m torch_patches`` / ``torch-patches``.

A thin layer: parse arguments, pick the target, call :mod:`torch_patches.ops`
or :mod:`torch_patches.wheel`, print, and turn :class:`TorchPatchesError` into
a message and a non-zero exit (no tracebacks for user mistakes).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional

from . import __version__
from .errors import TorchPatchesError


def _progress(msg: str) -> None:
    print(msg, flush=True)


def _series(args, target=None):
    """``--series DIR``, else the shipped series for the target's torch version."""
    from .series import default_series_dir, load_series
    if args.series:
        return load_series(args.series)
    return load_series(default_series_dir(target.base_version if target is not None else None))


def _target(args):
    if getattr(args, "source", None):
        from .targets.source import SourceTree
        return SourceTree(args.source)
    from .targets.installed import locate
    return locate(getattr(args, "python", None))


def cmd_status(args) -> int:
    from . import ops
    target = _target(args)
    print("\n".join(ops.status(target, _series(args, target))))
    return 0


def cmd_apply(args) -> int:
    from . import ops
    target = _target(args)
    print(ops.apply(target, _series(args, target)))
    return 0


def cmd_revert(args) -> int:
    from . import ops
    target = _target(args)
    print(ops.revert(target, _series(args, target)))
    return 0


def cmd_check(args) -> int:
    from . import ops
    target = _target(args)
    lines, error = ops.check(target, _series(args, target))
    print("\n".join(lines))
    if error is not None:
        raise error
    return 0


def _pip_options(args):
    from .wheel.fetch import PipOptions
    return PipOptions(index_url=args.index_url, extra_index_urls=tuple(args.extra_index_url),
                      find_links=tuple(args.find_links), platforms=tuple(args.platform),
                      python_version=args.python_version, abis=tuple(args.abi), implementation=args.implementation)


def _base_wheel(args, series, progress=_progress):
    """``--base``, else the cached or downloaded base wheel for ``--python`` / the target."""
    from .targets.installed import resolve_python
    from .wheel.fetch import obtain_base_wheel
    python = resolve_python(args.python) if args.python else None
    command = getattr(args, "as_command", None) or "python -m torch_patches " + " ".join(sys.argv[1:])
    return obtain_base_wheel(python, series.base, progress=progress, options=_pip_options(args),
                             command=command)


def cmd_wheel(args) -> int:
    from .wheel.build import build_wheel, verify_wheel
    started = time.monotonic()
    series = _series(args)
    base_wheel = args.base or _base_wheel(args, series)
    out = build_wheel(base_wheel, args.output, series, progress=_progress)
    if args.verify:
        _progress("verify: checking every RECORD hash ...")
        problems = verify_wheel(out)
        if problems:
            raise TorchPatchesError("the written wheel does not verify:\n  " + "\n  ".join(problems[:20]))
        _progress("verify: ok")
    print(f"wrote {out} in {time.monotonic() - started:.2f} s total")
    return 0


def cmd_fetch(args) -> int:
    """Print the path of the base wheel (cached, else downloaded); progress goes to stderr."""
    series = _series(args)
    print(_base_wheel(args, series, progress=lambda msg: print(msg, file=sys.stderr, flush=True)))
    return 0


def cmd_export(args) -> int:
    from pathlib import Path

    from .upstream import export as ex
    from .targets.pristine import pristine_base_files
    from .upstream.onto import check_onto
    series = _series(args)
    repo = Path(args.repo).resolve()
    results = ex.load_results(args.results)
    if args.run_tests:
        results_file = Path(args.results or Path(args.output) / "test-results.json")
        results_file.parent.mkdir(parents=True, exist_ok=True)
        results = ex.run_tests(ex.group_series(series), repo, args.run_tests, results_file, series.base.version,
                               progress=_progress)
    base_files = pristine_base_files(series, args.python, args.source, ex.base_prefixes(series),
                                     ex.docs_source_files(series))
    result = ex.export(series, base_files, args.output, repo, results=results, progress=_progress)
    for warning in result.warnings:
        print(f"warning: {warning}")
    print(f"export: {len(result.order)} patch(es) for {len(result.groups)} PR(s) -> {result.out} "
          f"(apply in the order of {result.out / 'series'})")
    if args.onto:
        lines, ok = check_onto(result.out, Path(args.onto))
        print("\n".join(lines))
        if not ok:
            return 1
    return 0


def cmd_torchtitan(args) -> int:
    from . import consumers
    return consumers.run_cli(args)


def cmd_manifest(args) -> int:
    from .series import default_series_dir, read_manifest
    directory = args.series or default_series_dir()
    manifest = read_manifest(directory)
    values = {"directory": str(directory), "base_version": manifest.base.version,
              "base_git_version": manifest.base.git_version, "revision": str(manifest.revision),
              "version": manifest.base.patched_version(manifest.revision),
              "local_label": manifest.base.local_label}
    if args.get:
        print(values[args.get])
    else:
        print("\n".join(f"{k}={v}" for k, v in values.items()))
    return 0


def _pinned() -> str:
    """How help texts name the shipped series' base (read from its manifest)."""
    from .series import default_series_dir, read_manifest
    try:
        manifest = read_manifest(default_series_dir())
    except TorchPatchesError:
        return "the torch release its manifest pins"
    return f"torch {manifest.base.short}"


def _epilog() -> str:
    from .wheel.fetch import cache_dir
    return ("exit status:\n"
            "  0  success\n"
            "  1  error: nothing was changed; the message says why and what to do\n"
            "  2  bad usage\n"
            "  3  refused: the target is not the pinned base torch (or comes from a patched wheel)\n"
            "base wheel cache (wheel, fetch, tools/run_tests.sh):\n"
            f"  {cache_dir()}\n"
            "  ($TORCH_PATCHES_CACHE, default ~/.cache/torch_patches); downloads use your pip configuration\n")


def build_parser() -> argparse.ArgumentParser:
    pinned = _pinned()
    parser = argparse.ArgumentParser(
        prog="torch-patches",
        description=f"Apply the FSDP lifecycle patch series to {pinned}, revert it,\n"
                    "or build a patched wheel.", epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--series", metavar="DIR", default=None,
                        help="use the series in DIR instead of the one shipped with the package")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def target_args(p, source_required=False):
        if source_required:
            p.add_argument("--source", metavar="DIR", required=True, help="PyTorch source tree")
            return
        group = p.add_mutually_exclusive_group()
        group.add_argument("--python", metavar="PY", help="interpreter whose torch to use (default: this one)")
        group.add_argument("--source", metavar="DIR", help="PyTorch source tree instead of an installed torch")

    p = sub.add_parser("status", parents=[common], help="show the torch and the state of each patch")
    target_args(p)
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("apply", parents=[common], help="apply the series in place (all or nothing)")
    target_args(p)
    p.set_defaults(func=cmd_apply)
    p = sub.add_parser("revert", parents=[common], help="restore the pristine files and RECORD")
    target_args(p)
    p.set_defaults(func=cmd_revert)
    p = sub.add_parser("check", parents=[common], help="dry run of apply against a source tree")
    target_args(p, source_required=True)
    p.set_defaults(func=cmd_check)
    pip = argparse.ArgumentParser(add_help=False)
    group = pip.add_argument_group(
        "base download", "passed to `pip download --no-deps torch==<base>`, which otherwise uses your pip "
        "configuration (pip.conf, PIP_* variables); a target option adds --only-binary=:all:")
    group.add_argument("--python", metavar="PY", help="interpreter (or venv directory) whose wheel tags "
                       "select the base wheel (default: this one)")
    group.add_argument("--index-url", metavar="URL")
    group.add_argument("--extra-index-url", metavar="URL", action="append", default=[])
    group.add_argument("--find-links", metavar="DIR_OR_URL", action="append", default=[])
    group.add_argument("--platform", metavar="PLAT", action="append", default=[],
                       help="e.g. manylinux_2_28_x86_64 (repeatable)")
    group.add_argument("--python-version", metavar="X.Y")
    group.add_argument("--abi", metavar="ABI", action="append", default=[])
    group.add_argument("--implementation", metavar="IMPL", help="cp, pp, ...")
    p = sub.add_parser("wheel", parents=[common, pip], epilog=_epilog(),
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="write the patched wheel <base>+<base label>.fsdp.N")
    p.add_argument("--base", metavar="WHEEL", help=f"base wheel of {pinned} (default: the cached one, else "
                   "download it with pip); e.g. a CPU or another CUDA build")
    p.add_argument("-o", "--output", metavar="DIR", default="dist", help="output directory (default: dist)")
    p.add_argument("--verify", action="store_true", help="re-read the written wheel and check every hash")
    p.set_defaults(func=cmd_wheel)
    p = sub.add_parser("fetch", parents=[common, pip], epilog=_epilog(),
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="print the path of the base wheel, from the cache or downloaded into it")
    p.add_argument("--as-command", help=argparse.SUPPRESS)  # how messages name the caller (run_tests.sh)
    p.set_defaults(func=cmd_fetch)
    p = sub.add_parser("export", parents=[common],
                       help="write the series as pytorch/pytorch PRs (git format-patch + PR.md per tracker)")
    p.add_argument("-o", "--output", metavar="DIR", default="upstream",
                   help="output directory (default: upstream)")
    p.add_argument("--onto", metavar="TREE", help="then check the export against this PyTorch tree")
    p.add_argument("--python", metavar="PY", help=f"interpreter whose {pinned} gives the pristine base files")
    p.add_argument("--source", metavar="DIR", help="source checkout of the base, for the files an installed "
                   "torch does not hold (docs/) that the series changes; with it, each PR with docs entries "
                   "gets a docs commit (without it, they go to the PR directory's DOCS.md)")
    p.add_argument("--repo", metavar="DIR", default=".",
                   help="torch-fsdp-lifecycle checkout holding test/ (default: the current directory)")
    p.add_argument("--results", metavar="FILE", help="recorded test results (JSON) for the Test Plan")
    p.add_argument("--run-tests", metavar="PY", help="run each PR's tests with PY (its torch must have the "
                   "series applied) and record them in --results (default: DIR/test-results.json)")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("torchtitan", help="apply/revert/status/export the torchtitan consumer series")
    from .consumers import add_cli_arguments
    add_cli_arguments(p)
    p.set_defaults(func=cmd_torchtitan)
    p = sub.add_parser("manifest", parents=[common], help="print the series' base, revision and wheel version")
    p.add_argument("--get", choices=("directory", "base_version", "base_git_version", "revision", "version",
                                     "local_label"),
                   help="print only this value")
    p.set_defaults(func=cmd_manifest)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TorchPatchesError as exc:
        print(f"torch-patches {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("torch-patches: interrupted", file=sys.stderr)
        return 130
