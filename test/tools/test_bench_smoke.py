"""Smoke test of the benchmarks in tools/bench: each script runs at a tiny size.

A benchmark is not a test: nothing here looks at timings or counts, only that
every script runs and prints its table. Scripts that need torch run with the
interpreter running pytest (the test venv has the patched torch 2.15.0);
torchtitan comparisons are left out (``--no-torchtitan``) unless torchtitan is
importable. The full run is ``bash tools/bench/run_all.sh`` (README, "Benchmarks").
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "tools" / "bench"


def run(*args: str, timeout: int = 120) -> str:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_collectives_tiny():
    out = run(str(BENCH / "collectives.py"), "--vocab", "64", "--dim", "8", "--seq", "8",
              "--layers", "1", "--microbatches", "2", "--num-chunks", "2", "--configs", "FSDP",
              "--methods", "a,c,d")
    assert "reduce-scatter" in out and "full logits" in out
    assert "error" not in out


def test_pp_collectives_tiny():
    out = run(str(BENCH / "pp_collectives.py"), "--schedules", "GPipe")
    assert "| GPipe | 3 |" in out


def test_step_time_tiny():
    extra = [] if importlib.util.find_spec("torchtitan") else ["--no-torchtitan"]
    out = run(str(BENCH / "step_time.py"), "--vocab", "64", "--dim", "8", "--layers", "1",
              "--seq", "8", "--microbatches", "2", "--num-chunks", "2", "--warmup", "1",
              "--steps", "1", *extra)
    assert "median ms/step" in out


def test_memory_tiny():
    out = run(str(BENCH / "memory.py"), "--dim", "8", "--num-chunks", "2",
              "--vocab-sweep", "256x16", "--seq-sweep", "256x16")
    assert "chunked: peak MiB" in out


def test_wheel_build_tiny(tmp_path):
    # A tiny stand-in wheel: only `cp` runs on it (the real comparison needs
    # the 2.15.0 base wheel and `wheel`; run_all.sh does that)
    whl = tmp_path / "torch-2.15.0-cp311-cp311-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("torch/__init__.py", "")
    out = run(str(BENCH / "wheel_build.py"), "--base", str(whl), "--repeat", "1", "--methods", "cp")
    assert "| cp" in out


def test_run_all_is_valid_bash():
    subprocess.run(["bash", "-n", str(BENCH / "run_all.sh")], check=True)
