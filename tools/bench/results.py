"""Benchmark result files: one JSON per measurement, saying where and when it was measured.

Every script in ``tools/bench`` writes its numbers with :func:`write`::

    {"benchmark": NAME, "meta": {...}, "params": {...}, "results": ...}

``meta`` holds the project commit (``-dirty`` when tracked files other than the
benchmarks' own output differ), the
torch version, the tool version and the shipped series revision, Python,
the CPU count and the machine load (1-minute load average before and after).
No host names or paths. :mod:`render` turns the files into the README's
tables. Standard library only (``wheel_build.py`` and ``render.py`` run
without torch).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from torch_patches import __version__ as tool_version  # noqa: E402
from torch_patches.series import default_series_dir, read_manifest  # noqa: E402


def _commit() -> str:
    def git(*args: str) -> str:
        proc = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    # The benchmarks' own output (result files, plots, the rendered block) does not make the code dirty:
    # run_all.sh rewrites those tracked files as it goes
    own = [f":(exclude){p}" for p in ("tools/bench/results", "docs/benchmarks.md")]
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no", "--", ".", *own) else "")


def torch_series() -> str:
    """The series applied to the installed torch (``2.15.0+fsdp.N``, from its ``TORCH_PATCHES.json``),
    or the plain torch version."""
    dist = importlib.metadata.distribution("torch")
    text = dist.read_text("TORCH_PATCHES.json")
    return json.loads(text)["version"] if text else dist.version


def load() -> float:
    """The 1-minute load average."""
    return round(os.getloadavg()[0], 2)


def meta(load_before: float, torch_version: Optional[str] = None) -> dict:
    manifest = read_manifest(default_series_dir())
    return {
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch_version,
        "torch_patches": tool_version,
        "series": manifest.base.patched_version(manifest.revision),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": load(),
    }


def write(path: Optional[Path], name: str, params: dict, results: Any, load_before: float,
          torch_version: Optional[str] = None) -> None:
    """Write one result file (nothing when ``path`` is ``None``)."""
    if path is None:
        return
    data = {"benchmark": name, "meta": meta(load_before, torch_version), "params": params, "results": results}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def read(path: Path) -> dict:
    return json.loads(Path(path).read_text())
