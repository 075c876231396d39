"""The composition tests' measured numbers (benchmark 6): reduce-scatters per
FSDP group per optimizer step and gradient error against the single-process
reference, per scenario of
``test/distributed/_composable/fsdp/test_fully_shard_lifecycle_compositions.py``
and ``test_fully_shard_lifecycle_compositions_eval.py`` (the scenarios that
also evaluate between steps).

Runs those test files with pytest, as a subprocess of ``--python`` (a venv with
the series applied), with ``FSDP_LIFECYCLE_RESULTS`` set: rank 0 of every test
then appends one JSON line per scenario and configuration (subtest) with what
it measured over its optimizer steps (the same numbers its assertions check).
Those lines, and pytest's pass/fail counts, go into the result file::

    python tools/bench/compositions.py --python PATCHED/bin/python --json R/compositions.json

Fails (exit 1, no result file) if pytest does not pass. Nothing here imports
the tests; ``-k`` selects a subset (quick runs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import render  # noqa: E402
import results  # noqa: E402
from results import REPO  # noqa: E402

TEST_FILES = ("test/distributed/_composable/fsdp/test_fully_shard_lifecycle_compositions.py",
              "test/distributed/_composable/fsdp/test_fully_shard_lifecycle_compositions_eval.py")
RESULTS_ENV = "FSDP_LIFECYCLE_RESULTS"


def pytest_counts(output: str) -> dict[str, int]:
    """``{"passed": n, "failed": n, ...}`` from pytest's summary line."""
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", default=sys.executable,
                   help="interpreter of a venv with the series applied (default: this one)")
    p.add_argument("-k", dest="select", help="pytest -k expression (default: every test)")
    p.add_argument("--json", type=Path, default=render.DEFAULT_RESULTS / "compositions.json",
                   help="write the results here (default: tools/bench/results/compositions.json)")
    args = p.parse_args()
    load_before = results.load()
    torch_version = subprocess.run([args.python, "-c", "import torch; print(torch.__version__)"],
                                   capture_output=True, text=True, check=True).stdout.strip()
    pytest_args = [*TEST_FILES, "-q", "-p", "no:cacheprovider", *(["-k", args.select] if args.select else [])]
    print(f"torch {torch_version}: python -m pytest {' '.join(pytest_args)}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        lines_path = Path(tmp, "compositions.jsonl")
        env = {**os.environ, RESULTS_ENV: str(lines_path), "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run([args.python, "-m", "pytest", *pytest_args], cwd=REPO, env=env,
                              capture_output=True, text=True)
        lines = lines_path.read_text().splitlines() if lines_path.exists() else []
    counts = pytest_counts(proc.stdout)
    if proc.returncode != 0 or not lines:
        print(proc.stdout[-5000:] + proc.stderr[-3000:], file=sys.stderr)
        print(f"compositions: pytest exited {proc.returncode} ({counts}); no result file written", file=sys.stderr)
        return 1
    rows = [json.loads(line) for line in lines]
    params = {"test_file": " ".join(TEST_FILES), "select": args.select, "pytest": counts,
              "command": "python tools/bench/compositions.py --python PATCHED/bin/python"
                         + (f" -k {args.select!r}" if args.select else "")}
    results.write(args.json, "compositions", params, rows, load_before, torch_version)
    print(f"pytest: {counts}")
    print(render.compositions_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
