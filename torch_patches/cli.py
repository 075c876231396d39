"""Command line: ``python -m torch_patches`` / ``torch-patches``.

A thin layer: parse arguments, pick the target, call :mod:`torch_patches.ops`
or :mod:`torch_patches.wheel`, print, and turn :class:`TorchPatchesError` into
a message and a non-zero exit (no tracebacks for user mistakes).
"""

from __future__ import annotations

import argparse
import os
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
    series = _series(args, target)
    print(ops.apply(target, series.upto(args.upto) if args.upto is not None else series))
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
    from .fsutil import resolve_python
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

    from . import stackcheck as sc
    from .upstream import export as ex
    from .targets.pristine import pristine_base_files
    from .upstream.onto import check_onto
    series = _series(args)
    repo = Path(args.repo).resolve()
    results = ex.load_results(args.results)
    groups = ex.group_series(series)
    stack = sc.for_export(series, groups, repo, args.output, args.check_stack, args.stack_results,
                          "python -m torch_patches " + " ".join(sys.argv[1:]),
                          recheck=args.recheck.split(",") if args.recheck else None, progress=_progress)
    if args.run_tests:
        results_file = Path(args.results or Path(args.output) / "test-results.json")
        results_file.parent.mkdir(parents=True, exist_ok=True)
        results = ex.run_tests(groups, repo, args.run_tests, results_file, series.base.version,
                               progress=_progress)
    base_files = pristine_base_files(series, args.python or args.check_stack, args.source,
                                     ex.base_prefixes(series), ex.docs_source_files(series))
    result = ex.export(series, base_files, args.output, repo, results=results, progress=_progress,
                       stack_lines=sc.test_plans(stack, series, groups, repo) if stack else None)
    for warning in result.warnings:
        print(f"warning: {warning}")
    print(f"export: {len(result.order)} patch(es) for {len(result.groups)} PR(s) -> {result.out} "
          f"(apply in the order of {result.out / 'series'})")
    status = 0
    if args.check_stack:
        stack_file = Path(args.stack_results or result.out / sc.RESULTS_NAME)
        stack.write(stack_file)
        print(stack.describe(stack_file))
        status = 0 if stack.ok else 1
    if args.onto:
        lines, ok = check_onto(result.out, Path(args.onto))
        print("\n".join(lines))
        status = status or (0 if ok else 1)
    return status


def cmd_changes(args) -> int:
    """Print (or write, or check) the what-changes table generated from the series."""
    from pathlib import Path

    from .changes import COMMAND, render
    text = render(_series(args))
    if args.check:
        path = Path(args.check)
        current = path.read_text(encoding="utf-8") if path.is_file() else None
        if current != text:
            raise TorchPatchesError(f"{path} is {'missing' if current is None else 'stale'}: the series changed "
                                    f"since it was generated; regenerate it with `{COMMAND}`")
        print(f"{path} is up to date")
    elif args.output:
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"wrote {args.output}")
    else:
        print(text, end="")
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


#: What each exit status means; a verb's help lists the ones it can return.
_EXIT = {
    0: "success",
    1: "error: nothing was changed; the message says why and what to do",
    2: "bad usage",
    3: "refused: the target is not the pinned base torch (or comes from a patched wheel)",
}


def _epilog(codes=(0, 1, 2, 3), cache: bool = False, **meaning: str) -> str:
    """The ``exit status`` section (``meaning`` rewords a code: ``c0="..."``), and for the
    verbs that use it, where the base wheel cache is."""
    text = "exit status:\n" + "".join(f"  {c}  {meaning.get(f'c{c}', _EXIT[c])}\n" for c in codes)
    if cache:
        from .wheel.fetch import cache_dir
        text += ("base wheel cache (wheel, fetch, tools/run_tests.sh):\n"
                 f"  {cache_dir()}\n"
                 "  ($TORCH_PATCHES_CACHE, default ~/.cache/torch_patches); downloads use your pip configuration\n")
    return text


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Wraps descriptions to the terminal; lines that start with a space (tables such as the
    exit status) are kept as they are."""

    def _fill_text(self, text, width, indent):
        import textwrap
        out: List[str] = []
        paragraph: List[str] = []

        def flush():
            if paragraph:
                out.extend(textwrap.wrap(" ".join(paragraph), width, initial_indent=indent,
                                         subsequent_indent=indent))
                paragraph.clear()

        for line in text.splitlines():
            if line.startswith(" ") or not line.strip():
                flush()
                out.append(indent + line if line.strip() else "")
            else:
                paragraph.append(line.strip())
        flush()
        return "\n".join(out)


class _Version(argparse.Action):
    """``--version``: the tool's version and the series it carries (read when asked)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog} {__version__}")
        print("\n".join(_carried()))
        parser.exit()


def _carried() -> List[str]:
    """One line per shipped series: revision, patch count, base and wheel version."""
    from .series import load_series, shipped_series_dirs
    lines = []
    for directory in shipped_series_dirs():
        try:
            series = load_series(directory)
        except TorchPatchesError as exc:
            lines.append(f"series: {directory}: {exc}")
            continue
        base = series.base
        lines.append(f"series: revision {series.revision}, {len(series.patches)} patches, for torch {base.short}; "
                     f"wheel version {base.patched_version(series.revision, '<base label>')}")
    from .consumers import load_consumer_series
    try:
        consumer = load_consumer_series()
    except TorchPatchesError:  # consumers/ ships with a checkout, not with an installed package
        return lines
    lines.append(f"{consumer.distribution} series: revision {consumer.revision}, {len(consumer.patches)} "
                 f"patches, for {consumer.distribution} {consumer.version}")
    return lines


_PYTHON_HELP = ("interpreter whose torch to use, or a virtual environment's directory (VENV: its bin/python); "
                "default: this one")


def build_parser() -> argparse.ArgumentParser:
    pinned = _pinned()
    parser = argparse.ArgumentParser(
        prog="torch-patches",
        description=f"Apply the FSDP lifecycle patch series to {pinned}, revert it,\n"
                    "or build a patched wheel. `torch-patches COMMAND --help` describes each command.",
        epilog=_epilog(cache=True), formatter_class=_Formatter)
    parser.add_argument("--version", action=_Version, help="print the version and the series it carries")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--series", metavar="DIR", default=None,
                        help="use the series in DIR instead of the one shipped with the package")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def verb(name, summary, description, epilog, parents=(common,)):
        return sub.add_parser(name, parents=list(parents), help=summary, description=description, epilog=epilog,
                              formatter_class=_Formatter)

    def target_args(p, source_required=False):
        if source_required:
            p.add_argument("--source", metavar="DIR", required=True, help="PyTorch source tree")
            return
        group = p.add_mutually_exclusive_group()
        group.add_argument("--python", metavar="PY", help=_PYTHON_HELP)
        group.add_argument("--source", metavar="DIR", help="PyTorch source tree instead of an installed torch")

    p = verb("status", "show the torch and the state of each patch",
             f"Show the interpreter's torch (version, commit, and whether it is the pinned base, {pinned})\n"
             "and each patch's state (applied, not applied, retired, changed since apply).\nChanges nothing.",
             _epilog((0, 1, 2), c0="the status was printed (a torch that is not the pinned base: `pinned base: NO`)"))
    target_args(p)
    p.set_defaults(func=cmd_status)
    p = verb("apply", "apply the series in place (all or nothing)",
             f"Apply the series in place to an installed {pinned} (or a source tree), all or nothing:\n"
             "every file is computed in memory and swapped in only when all are staged. A marker in\n"
             "the dist-info records the series and the pristine bytes (for revert). Applied twice, it\n"
             "says so; over an older series revision it upgrades in one step.", _epilog())
    target_args(p)
    p.add_argument("--upto", metavar="N", type=int, help="apply only the first N patches (the series as far "
                   "as one PR of the exported stack); revert and a later apply work as for the whole series")
    p.set_defaults(func=cmd_apply)
    p = verb("revert", "restore the pristine files and RECORD",
             "Restore the files and RECORD that apply replaced, byte for byte, from the marker apply\n"
             "wrote. Without the series applied it says there is nothing to revert.", _epilog())
    target_args(p)
    p.set_defaults(func=cmd_revert)
    p = verb("check", "dry run of apply against a source tree",
             "Dry run of apply against a PyTorch source tree: each patch's state and whether apply\n"
             "would succeed. Changes nothing.", _epilog(c0="apply would succeed (or the series is already applied)"))
    target_args(p, source_required=True)
    p.set_defaults(func=cmd_check)
    pip = argparse.ArgumentParser(add_help=False)
    group = pip.add_argument_group(
        "base download", "passed to `pip download --no-deps torch==<base>`, which otherwise uses your pip "
        "configuration (pip.conf, PIP_* variables); a target option adds --only-binary=:all:")
    group.add_argument("--python", metavar="PY", help="interpreter, or a virtual environment's directory, whose "
                       "wheel tags select the base wheel (default: this one)")
    group.add_argument("--index-url", metavar="URL")
    group.add_argument("--extra-index-url", metavar="URL", action="append", default=[])
    group.add_argument("--find-links", metavar="DIR_OR_URL", action="append", default=[])
    group.add_argument("--platform", metavar="PLAT", action="append", default=[],
                       help="e.g. manylinux_2_28_x86_64 (repeatable)")
    group.add_argument("--python-version", metavar="X.Y")
    group.add_argument("--abi", metavar="ABI", action="append", default=[])
    group.add_argument("--implementation", metavar="IMPL", help="cp, pp, ...")
    p = verb("wheel", "write the patched wheel <base>+<base label>.fsdp.N",
             f"Write the patched wheel of {pinned}: the base wheel's members copied as they are, the\n"
             "series' files patched, and the version <base>+<base label>.fsdp.N in the file name,\n"
             "METADATA, the dist-info directory and torch.__version__. The base is --base, else the\n"
             "cached one, else downloaded into the cache with pip.", _epilog(cache=True), (common, pip))
    p.add_argument("--base", metavar="WHEEL", help=f"base wheel of {pinned} (default: the cached one, else "
                   "download it with pip); e.g. a CPU or another CUDA build")
    p.add_argument("-o", "--output", metavar="DIR", default="dist", help="output directory (default: dist)")
    p.add_argument("--verify", action="store_true", help="re-read the written wheel and check every hash")
    p.set_defaults(func=cmd_wheel)
    p = verb("fetch", "print the path of the base wheel, from the cache or downloaded into it",
             f"Print the path of the {pinned} base wheel for --python (or the target options): from\n"
             "the cache, else downloaded into it with pip. Progress goes to stderr, the path to stdout.",
             _epilog((0, 1, 2), cache=True), (common, pip))
    p.add_argument("--as-command", help=argparse.SUPPRESS)  # how messages name the caller (run_tests.sh)
    p.set_defaults(func=cmd_fetch)
    p = verb("export", "write the series as pytorch/pytorch PRs (git format-patch + PR.md per tracker)",
             "Write the series as a pytorch/pytorch PR stack: one directory per tracker issue with its\n"
             "git format-patch files and PR.md, and a `series` file with the order to apply them.\n"
             f"The pristine base files come from --python's {pinned} (and --source for docs/).",
             _epilog((0, 1, 2), c1="error; --onto: the export does not apply to TREE (the output names the "
                               "patch); --check-stack: a PR fails its tests on its own"))
    p.add_argument("-o", "--output", metavar="DIR", default="upstream",
                   help="output directory (default: upstream)")
    p.add_argument("--onto", metavar="TREE", help="then check the export against this PyTorch tree")
    p.add_argument("--python", metavar="PY", help=f"interpreter, or a virtual environment's directory, whose "
                   f"{pinned} gives the pristine base files (default: this one)")
    p.add_argument("--source", metavar="DIR", help="source checkout of the base, for the files an installed "
                   "torch does not hold (docs/) that the series changes; with it, each PR with docs entries "
                   "gets a docs commit (without it, they go to the PR directory's DOCS.md)")
    p.add_argument("--repo", metavar="DIR", default=".",
                   help="torch-fsdp-lifecycle checkout holding test/ (default: the current directory)")
    p.add_argument("--results", metavar="FILE", help="recorded test results (JSON) for the Test Plan")
    p.add_argument("--run-tests", metavar="PY", help="run each PR's tests with PY, an interpreter or a virtual "
                   "environment's directory (its torch must have the "
                   "series applied) and record them in --results (default: DIR/test-results.json)")
    p.add_argument("--check-stack", metavar="VENV", help="check that each PR stands alone: for PR k, a "
                   f"hard-linked copy of VENV (its torch must be the pristine {pinned}, with pytest) gets the "
                   "patches of PRs 1..k and runs PR k's tests; the results go into each PR.md and "
                   "--stack-results (default: DIR/stack-check.json); exit status 1 if a PR fails")
    p.add_argument("--stack-results", metavar="FILE", help="where --check-stack writes its results; without "
                   "--check-stack, earlier results to show in each PR.md (a PR whose patches or tests changed "
                   "since is shown as stale)")
    p.add_argument("--recheck", metavar="PR[,PR...]", help="with --check-stack: check only these PRs (their "
                   "directory names, e.g. 203177,new-0015) and keep the other PRs' results from --stack-results")
    p.set_defaults(func=cmd_export)
    p = verb("changes", "print the table of what each patch changes (generated from the series)",
             "Print a Markdown table with one row per patch of the series: the files it touches, the\n"
             "public names it adds (its subject and the public def/class lines it adds), whether code\n"
             "that calls no new API can see it (the series' changes.ini, one line per patch), and its PR.\n"
             "docs/what-changes.md is this output; --check compares a file with it.",
             _epilog((0, 1, 2), c1="error: a patch has no line in changes.ini, or --check: the file differs"))
    p.add_argument("-o", "--output", metavar="FILE", help="write the table to FILE instead of printing it")
    p.add_argument("--check", metavar="FILE", help="exit 1 (and say how to regenerate it) if FILE is not the "
                   "table the series gives now")
    p.set_defaults(func=cmd_changes)
    p = verb(
        "torchtitan", "apply/revert/status/export the torchtitan consumer series",
        "The torchtitan consumer series (its ChunkedLossWrapper on the FSDP lifecycle APIs)\n"
        "for the torchtitan installed for --python, with the same all-or-nothing replacement\n"
        "and marker as the torch series. The action is one of:\n"
        "  status  the installed torchtitan and whether the series is applied; changes nothing\n"
        "  apply   apply the series in place (all or nothing)\n"
        "  revert  restore the files and RECORD that apply replaced, byte for byte\n"
        "  export  write the series as torchtitan PR files (git am patches + PR.md) into -o DIR\n"
        "--target main-<commit> selects the series against torchtitan main (status and export\n"
        "with --source DIR or $TORCHTITAN_SOURCE: torchtitan's sources).",
        _epilog(c1=_EXIT[1] + "; status of a main-<commit> series: it conflicts with --onto",
                c3="refused: the installed torchtitan is not the release the series is pinned to, "
                   "or a main-<commit> series given to apply/revert"), ())
    from .consumers import add_cli_arguments
    add_cli_arguments(p)
    p.set_defaults(func=cmd_torchtitan)
    p = verb("manifest", "print the series' base, revision and wheel version",
             "Print the series' base (version, commit), revision and patched wheel version from its\n"
             "manifest.ini, as key=value lines (or one value with --get); CMake and\n"
             "tools/run_tests.sh read it.", _epilog((0, 1, 2)))
    p.add_argument("--get", choices=("directory", "base_version", "base_git_version", "revision", "version",
                                     "local_label"),
                   help="print only this value")
    p.set_defaults(func=cmd_manifest)
    return parser


#: The exit status when the reader of the output went away (`status | head`): 128 + SIGPIPE, as a
#: shell reports for a command that a closed pipe stopped.
BROKEN_PIPE = 141


def _stdout_gone() -> int:
    """The reader of stdout closed the pipe: stop without a traceback (and without the one the
    interpreter would print when it flushes stdout at exit)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return BROKEN_PIPE


def main(argv: Optional[List[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        try:
            return args.func(args)
        except TorchPatchesError as exc:
            print(f"torch-patches {args.command}: error: {exc}", file=sys.stderr)
            return exc.exit_code
    except KeyboardInterrupt:
        print("torch-patches: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _stdout_gone()
