"""
Patched-wheel build time (benchmark 4): ``python -m torch_patches wheel``
vs a plain ``cp`` of the base wheel vs ``wheel unpack`` + ``wheel pack``.

Each method runs ``--repeat`` times into an emptied output directory, wall time
of the whole command (interpreter start included); the median is printed. The
base wheel is read once first so every method finds it in the page cache.
``wheel`` must be importable by ``--wheel-python`` (default: this interpreter).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_BASES = [
    os.environ.get("TORCH_PATCHES_BASE_WHEEL", ""),
    "/root/wheelcache/torch-2.15.0-cp311-cp311-manylinux_2_28_x86_64.whl",
]


def find_base() -> Path | None:
    for cand in DEFAULT_BASES:
        if cand and Path(cand).is_file():
            return Path(cand)
    cache = Path(os.environ.get("TORCH_PATCHES_CACHE", Path.home() / ".cache" / "torch_patches"))
    found = sorted(cache.glob("**/torch-2.15.0-*.whl"))
    return found[0] if found else None


def timed(cmds: list[list[str]], out: Path, cwd: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    for cmd in cmds:
        subprocess.run(cmd, check=True, cwd=cwd, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, default=None, help="base torch 2.15.0 wheel")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--methods", default="cp,torch-patches,unpack+pack")
    p.add_argument("--wheel-python", default=sys.executable, help="interpreter with `wheel` installed")
    args = p.parse_args()
    base = args.base or find_base()
    if base is None:
        sys.exit("no base wheel: pass --base or set TORCH_PATCHES_BASE_WHEEL")
    base = base.resolve()
    with open(base, "rb") as fh:  # warm the page cache
        while fh.read(1 << 24):
            pass
    print(f"base wheel {base} ({base.stat().st_size / 1e6:.0f} MB); {args.repeat} runs per method",
          flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "out")
        work = Path(tmp, "work")
        for method in args.methods.split(","):
            times = []
            for _ in range(args.repeat if method != "unpack+pack" else 1):
                if method == "cp":
                    times.append(timed([["cp", str(base), str(out)]], out, REPO))
                elif method == "torch-patches":
                    times.append(timed([[sys.executable, "-m", "torch_patches", "wheel", "--base",
                                         str(base), "-o", str(out)]], out, REPO))
                elif method == "unpack+pack":
                    shutil.rmtree(work, ignore_errors=True)
                    work.mkdir()
                    name = base.name.split("-")[0] + "-" + base.name.split("-")[1]
                    times.append(timed([[args.wheel_python, "-m", "wheel", "unpack", "-d", str(work), str(base)],
                                        [args.wheel_python, "-m", "wheel", "pack", "-d", str(out),
                                         str(work / name)]], out, REPO))
                else:
                    sys.exit(f"unknown method {method}")
            rows.append([method, len(times), f"{statistics.median(times):.2f}", f"{min(times):.2f}",
                         f"{max(times):.2f}"])
            print(f"  {method}: {', '.join(f'{t:.2f}' for t in times)} s", flush=True)
    print(_table(["method", "runs", "median s", "min s", "max s"], rows))


def _table(headers, rows):
    cells = [[str(c) for c in r] for r in [headers, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
