"""
Patched-wheel build time (benchmark 4): ``python -m torch_patches wheel``
vs a plain ``cp`` of the base wheel vs ``wheel unpack`` + ``wheel pack``.

Each method runs ``--repeat`` times into an emptied output directory, wall time
of the whole command (interpreter start included); ``torch-patches`` also
reports the build time it prints itself. The base wheel is read once first so
every method finds it in the page cache. The base wheel is ``--base``, else
the one ``torch-patches wheel`` itself uses (its cache, or ``pip download``).
``wheel`` must be importable by ``--wheel-python`` (default: this interpreter).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import render  # noqa: E402
import results  # noqa: E402
from results import REPO  # noqa: E402

from torch_patches.series import load_series  # noqa: E402
from torch_patches.wheel.fetch import obtain_base_wheel  # noqa: E402


def timed(cmds: list[list[str]], out: Path) -> tuple[float, str]:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    stdout = "".join(subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, text=True).stdout
                     for cmd in cmds)
    return time.perf_counter() - t0, stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, default=None, help="base torch wheel (default: torch-patches' own)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--methods", default="cp,torch-patches,unpack+pack")
    p.add_argument("--wheel-python", default=sys.executable, help="interpreter with `wheel` installed")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args()
    load_before = results.load()
    base = (args.base or obtain_base_wheel(sys.executable, load_series().base)).resolve()
    with open(base, "rb") as fh:  # warm the page cache
        while fh.read(1 << 24):
            pass
    print(f"base wheel {base.name} ({base.stat().st_size / 1e6:.0f} MB); {args.repeat} runs per method", flush=True)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        out, work = Path(tmp, "out"), Path(tmp, "work")
        for method in args.methods.split(","):
            times, own = [], []
            for _ in range(args.repeat if method != "unpack+pack" else 1):
                if method == "cp":
                    times.append(timed([["cp", str(base), str(out)]], out)[0])
                elif method == "torch-patches":
                    elapsed, stdout = timed([[sys.executable, "-m", "torch_patches", "wheel", "--base", str(base),
                                              "-o", str(out)]], out)
                    times.append(elapsed)
                    m = re.search(r"in ([\d.]+) s total", stdout)
                    if m:
                        own.append(float(m.group(1)))
                elif method == "unpack+pack":
                    shutil.rmtree(work, ignore_errors=True)
                    work.mkdir()
                    name = "-".join(base.name.split("-")[:2])
                    times.append(timed([[args.wheel_python, "-m", "wheel", "unpack", "-d", str(work), str(base)],
                                        [args.wheel_python, "-m", "wheel", "pack", "-d", str(out),
                                         str(work / name)]], out)[0])
                else:
                    sys.exit(f"unknown method {method}")
            rows[method] = {"wall": times, "own": own}
            print(f"  {method}: {', '.join(f'{t:.2f}' for t in times)} s", flush=True)
    params = {"base_wheel": base.name, "base_mb": round(base.stat().st_size / 1e6), "repeat": args.repeat}
    results.write(args.json, "wheel_build", params, rows, load_before)
    print(render.wheel_table(rows))


if __name__ == "__main__":
    main()
